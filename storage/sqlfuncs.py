"""The functions free SQL may call: an allowlist of pure functions, grouped by family.

Free SQL (``Store.query``: ``stragglerscope sql --query``, the console's SQL
tab) may call a function only if its name is here (``storage.sandbox``
checks every ``name(`` in the statement). Everything here computes a value
from its arguments and nothing else: no files, network, processes,
dictionaries, settings, other tables, server or session state (user, host,
uptime, query ids), no sleeping. A function missing here is refused even if
it is harmless; add it to its family after checking what it does.

Names match case-insensitively (ClickHouse accepts ``COUNT`` and ``count``;
a name that exists only in another case is unknown to the engine anyway).
``tests/storage/test_sql_sandbox.py`` checks against chDB's
``system.functions`` that no engine function outside this list shares a
lower-case name with one inside it, and that no table function is here.

Aggregate functions may carry combinator suffixes (``sumIf``,
``uniqExactArray``, ``avgState``, ``quantileExactMerge``, ...): a name is
allowed if it is an aggregate below followed by combinators of
``AGGREGATE_COMBINATORS``.
"""
from __future__ import annotations


def _variants(bases: tuple[str, ...], suffixes: tuple[str, ...]) -> frozenset[str]:
    """Each base name, and each with each suffix (``toInt32``, ``toInt32OrZero``, ...)."""
    return frozenset(bases) | frozenset(b + s for b in bases for s in suffixes)


AGGREGATE = frozenset({
    # counting, sums, extremes
    "count", "sum", "avg", "min", "max", "any", "anyLast", "anyHeavy", "any_value", "first_value", "last_value",
    "argMin", "argMax", "min_by", "max_by", "sumWithOverflow", "sumKahan", "sumCount", "avgWeighted",
    "singleValueOrNull", "boundingRatio", "deltaSum", "deltaSumTimestamp", "intervalLengthSum",
    # distinct counts
    "uniq", "uniqExact", "uniqCombined", "uniqCombined64", "uniqHLL12", "uniqUpTo",
    # arrays and maps of values
    "groupArray", "groupUniqArray", "groupArrayInsertAt", "groupArrayMovingAvg", "groupArrayMovingSum",
    "groupArraySample", "groupArraySorted", "groupArrayLast", "groupArrayIntersect", "array_agg", "groupConcat",
    "group_concat", "string_agg", "sumMap", "minMap", "maxMap", "sumMapWithOverflow", "sumMapFiltered",
    "groupBitAnd", "groupBitOr", "groupBitXor", "BIT_AND", "BIT_OR", "BIT_XOR", "groupBitmap", "groupBitmapAnd",
    "groupBitmapOr", "groupBitmapXor",
    # quantiles
    "median", "medianExact", "medianExactLow", "medianExactHigh", "medianExactWeighted", "medianTiming",
    "medianTDigest", "medianDeterministic", "medianBFloat16", "medianGK", "medianDD",
    "quantile", "quantileExact", "quantileExactLow", "quantileExactHigh", "quantileExactExclusive",
    "quantileExactInclusive", "quantileExactWeighted", "quantileExactWeightedInterpolated",
    "quantileInterpolatedWeighted", "quantileTiming", "quantileTimingWeighted", "quantileTDigest",
    "quantileTDigestWeighted", "quantileDeterministic", "quantileBFloat16", "quantileBFloat16Weighted",
    "quantileGK", "quantileDD",
    "quantiles", "quantilesExact", "quantilesExactLow", "quantilesExactHigh", "quantilesExactExclusive",
    "quantilesExactInclusive", "quantilesExactWeighted", "quantilesTiming", "quantilesTimingWeighted",
    "quantilesTDigest", "quantilesTDigestWeighted", "quantilesDeterministic", "quantilesBFloat16", "quantilesGK",
    "quantilesDD",
    # statistics
    "varPop", "varSamp", "stddevPop", "stddevSamp", "VAR_POP", "VAR_SAMP", "STDDEV_POP", "STDDEV_SAMP", "STD",
    "STDDEV", "varPopStable", "varSampStable", "stddevPopStable", "stddevSampStable", "covarPop", "covarSamp",
    "COVAR_POP", "COVAR_SAMP", "covarPopStable", "covarSampStable", "corr", "corrStable", "skewPop", "skewSamp",
    "kurtPop", "kurtSamp", "entropy", "rankCorr", "simpleLinearRegression", "mannWhitneyUTest", "studentTTest",
    "welchTTest", "meanZTest", "kolmogorovSmirnovTest", "cramersV", "cramersVBiasCorrected", "theilsU",
    "contingency", "regr_slope", "regr_intercept", "regr_r2", "regr_count", "regr_avgx", "regr_avgy", "regr_sxx",
    "regr_syy", "regr_sxy",
    # top values, histograms, sequences
    "topK", "topKWeighted", "approx_top_k", "approx_top_count", "approx_top_sum", "histogram", "retention",
    "windowFunnel", "sequenceMatch", "sequenceCount", "maxIntersections", "maxIntersectionsPosition",
    "exponentialMovingAverage", "sparkbar", "sparkBar", "largestTriangleThreeBuckets", "lttb",
})

WINDOW = frozenset({
    "row_number", "rank", "dense_rank", "denseRank", "percent_rank", "percentRank", "cume_dist", "ntile",
    "lag", "lead", "lagInFrame", "leadInFrame", "nth_value", "nonNegativeDerivative",
    "exponentialTimeDecayedAvg", "exponentialTimeDecayedCount", "exponentialTimeDecayedMax",
    "exponentialTimeDecayedSum",
})

AGGREGATE_COMBINATORS = ("If", "Array", "Map", "SimpleState", "State", "Merge", "ForEach", "OrDefault", "OrNull",
                         "Resample", "Distinct", "ArgMin", "ArgMax", "Null")

ARITHMETIC = frozenset({
    "plus", "minus", "multiply", "divide", "intDiv", "intDivOrZero", "intDivOrNull", "divideOrNull", "modulo",
    "moduloOrZero", "moduloOrNull", "mod", "positiveModulo", "positive_modulo", "pmod", "negate", "abs", "gcd",
    "lcm", "min2", "max2", "midpoint", "isFinite", "isInfinite", "isNaN", "ifNotFinite",
})

MATH = frozenset({
    "e", "pi", "exp", "exp2", "exp10", "log", "ln", "log2", "log10", "log1p", "sqrt", "cbrt", "pow", "power",
    "intExp2", "intExp10", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh",
    "acosh", "atanh", "hypot", "erf", "erfc", "lgamma", "tgamma", "sign", "sigmoid", "degrees", "radians",
    "factorial", "widthBucket", "width_bucket",
})

ROUNDING = frozenset({
    "round", "roundBankers", "floor", "ceil", "ceiling", "trunc", "truncate", "roundToExp2", "roundDuration",
    "roundAge", "roundDown",
})

COMPARISON_AND_LOGIC = frozenset({
    "equals", "notEquals", "less", "greater", "lessOrEquals", "greaterOrEquals", "isDistinctFrom",
    "isNotDistinctFrom", "and", "or", "not", "xor",
})

CONDITIONAL_AND_NULL = frozenset({
    "if", "multiIf", "greatest", "least", "clamp", "coalesce", "ifNull", "nullIf", "isNull", "isNotNull",
    "assumeNotNull", "toNullable", "isZeroOrNull",
})

_INT_TYPES = ("Int8", "Int16", "Int32", "Int64", "Int128", "Int256",
              "UInt8", "UInt16", "UInt32", "UInt64", "UInt128", "UInt256")
TYPE_CONVERSION = (
    _variants(tuple("to" + t for t in _INT_TYPES) + ("toFloat32", "toFloat64", "toDate", "toDate32", "toDateTime",
                                                     "toDateTime64", "toDecimal32", "toDecimal64", "toDecimal128",
                                                     "toDecimal256", "toUUID", "toIPv4", "toIPv6"),
              ("OrZero", "OrNull", "OrDefault"))
    | _variants(("parseDateTimeBestEffort", "parseDateTimeBestEffortUS", "parseDateTime64BestEffort",
                 "parseDateTime64BestEffortUS", "parseDateTime32BestEffort", "parseDateTime", "parseDateTime64"),
                ("OrZero", "OrNull"))
    | frozenset({
        "toString", "toFixedString", "toStringCutToZero", "toBool", "toLowCardinality", "toDecimalString",
        "CAST", "accurateCast", "accurateCastOrNull", "accurateCastOrDefault", "toTypeName", "DATE", "timestamp",
        "toUnixTimestamp", "fromUnixTimestamp", "FROM_UNIXTIME", "toUnixTimestamp64Second",
        "toUnixTimestamp64Milli", "toUnixTimestamp64Micro", "toUnixTimestamp64Nano", "fromUnixTimestamp64Second",
        "fromUnixTimestamp64Milli", "fromUnixTimestamp64Micro", "fromUnixTimestamp64Nano", "reinterpretAsString",
        "reinterpretAsUInt64", "reinterpretAsInt64", "reinterpretAsFloat64", "toInterval", "toIntervalNanosecond",
        "toIntervalMicrosecond", "toIntervalMillisecond", "toIntervalSecond", "toIntervalMinute", "toIntervalHour",
        "toIntervalDay", "toIntervalWeek", "toIntervalMonth", "toIntervalQuarter", "toIntervalYear",
    })
)

DATES_AND_TIMES = frozenset({
    "now", "now64", "today", "yesterday", "current_date", "curdate", "current_timestamp", "localtimestamp",
    "toYear", "toQuarter", "toMonth", "toDayOfMonth", "toDayOfWeek", "toDayOfYear", "toHour", "toMinute",
    "toSecond", "toMillisecond", "toMicrosecond", "toNanosecond", "YEAR", "QUARTER", "MONTH", "DAY", "DAYOFMONTH",
    "DAYOFWEEK", "DAYOFYEAR", "HOUR", "MINUTE", "SECOND", "toISOWeek", "toISOYear", "toWeek", "week", "toYearWeek",
    "yearweek", "toMonday", "toStartOfYear", "toStartOfISOYear", "toStartOfQuarter", "toStartOfMonth",
    "toStartOfWeek", "toStartOfDay", "toStartOfHour", "toStartOfMinute", "toStartOfSecond",
    "toStartOfMillisecond", "toStartOfMicrosecond", "toStartOfNanosecond", "toStartOfFiveMinutes",
    "toStartOfFiveMinute", "toStartOfTenMinutes", "toStartOfFifteenMinutes", "toStartOfInterval", "date_bin",
    "time_bucket", "toLastDayOfMonth", "LAST_DAY", "toLastDayOfWeek", "toDaysSinceYearZero",
    "fromDaysSinceYearZero", "toModifiedJulianDay", "fromModifiedJulianDay", "toYYYYMM", "toYYYYMMDD",
    "toYYYYMMDDhhmmss", "YYYYMMDDToDate", "YYYYMMDDhhmmssToDateTime", "toRelativeYearNum", "toRelativeQuarterNum",
    "toRelativeMonthNum", "toRelativeWeekNum", "toRelativeDayNum", "toRelativeHourNum", "toRelativeMinuteNum",
    "toRelativeSecondNum", "toTimezone", "toTimeZone", "toUTCTimestamp", "fromUTCTimestamp", "formatDateTime",
    "DATE_FORMAT", "formatDateTimeInJodaSyntax", "dateDiff", "date_diff", "DATE_DIFF", "timestampDiff",
    "timestamp_diff", "age", "dateTrunc", "date_trunc", "DATE_TRUNC", "dateName", "monthName", "timeSlot",
    "timeSlots", "makeDate", "makeDate32", "makeDateTime", "makeDateTime64", "addYears", "addQuarters",
    "addMonths", "addWeeks", "addDays", "addHours", "addMinutes", "addSeconds", "addMilliseconds",
    "addMicroseconds", "addNanoseconds", "addInterval", "addDate", "subtractYears", "subtractQuarters",
    "subtractMonths", "subtractWeeks", "subtractDays", "subtractHours", "subtractMinutes", "subtractSeconds",
    "subtractMilliseconds", "subtractMicroseconds", "subtractNanoseconds", "subtractInterval", "subDate",
    "tumble", "tumbleStart", "tumbleEnd", "hop", "hopStart", "hopEnd",
})

STRINGS = frozenset({
    "length", "lengthUTF8", "char_length", "CHAR_LENGTH", "CHARACTER_LENGTH", "OCTET_LENGTH", "empty", "notEmpty",
    "lower", "upper", "lcase", "ucase", "lowerUTF8", "upperUTF8", "initcap", "initcapUTF8", "reverse", "reverseUTF8",
    "concat", "concatWithSeparator", "concat_ws", "concatAssumeInjective", "substring", "substr", "mid",
    "substringUTF8", "byteSlice", "substringIndex", "substringIndexUTF8", "SUBSTRING_INDEX", "left", "right",
    "leftUTF8", "rightUTF8", "leftPad", "rightPad", "lpad", "rpad", "leftPadUTF8", "rightPadUTF8", "trim",
    "trimLeft", "trimRight", "trimBoth", "ltrim", "rtrim", "repeat", "space", "appendTrailingCharIfAbsent",
    "firstLine", "toValidUTF8", "isValidUTF8", "isValidASCII", "naturalSortKey", "normalizeUTF8NFC",
    "normalizeUTF8NFD", "normalizeUTF8NFKC", "normalizeUTF8NFKD", "removeDiacriticsUTF8",
    "formatReadableSize", "formatReadableDecimalSize", "formatReadableQuantity", "formatReadableTimeDelta",
    "FORMAT_BYTES", "parseReadableSize", "parseReadableSizeOrNull", "parseReadableSizeOrZero",
    "editDistance", "editDistanceUTF8", "levenshteinDistance", "levenshteinDistanceUTF8",
    "damerauLevenshteinDistance", "jaroSimilarity", "jaroWinklerSimilarity", "stringJaccardIndex",
    "stringJaccardIndexUTF8", "byteHammingDistance", "soundex", "visibleWidth", "bar",
})

STRING_SEARCH_AND_REPLACE = frozenset({
    "position", "positionCaseInsensitive", "positionUTF8", "positionCaseInsensitiveUTF8", "locate", "instr",
    "startsWith", "endsWith", "startsWithUTF8", "endsWithUTF8", "startsWithCaseInsensitive",
    "endsWithCaseInsensitive", "like", "notLike", "ilike", "notILike", "match", "REGEXP_MATCHES",
    "multiSearchAny", "multiSearchFirstIndex", "multiSearchFirstPosition", "multiSearchAllPositions", "hasToken",
    "hasTokenCaseInsensitive", "hasSubsequence", "countSubstrings", "countSubstringsCaseInsensitive",
    "countMatches", "countMatchesCaseInsensitive", "extract", "extractAll", "extractGroups",
    "extractAllGroupsHorizontal", "extractAllGroupsVertical", "regexpExtract", "REGEXP_EXTRACT", "REGEXP_SUBSTR",
    "ngramDistance", "ngramSearch",
    "replace", "replaceAll", "replaceOne", "replaceRegexpAll", "replaceRegexpOne", "REGEXP_REPLACE",
    "regexpQuoteMeta", "translate", "translateUTF8", "overlay", "overlayUTF8",
    "splitByChar", "splitByString", "splitByRegexp", "splitByWhitespace", "splitByNonAlpha", "splitByAlpha",
    "alphaTokens", "arrayStringConcat", "array_to_string", "ngrams", "tokens",
})

ENCODING_AND_HASHING = frozenset({
    "hex", "unhex", "bin", "unbin", "base64Encode", "base64Decode", "tryBase64Decode", "TO_BASE64", "FROM_BASE64",
    "base64URLEncode", "base64URLDecode", "base58Encode", "base58Decode", "encodeURLComponent",
    "decodeURLComponent", "encodeXMLComponent", "decodeXMLComponent",
    "cityHash64", "sipHash64", "sipHash128", "farmHash64", "farmFingerprint64", "metroHash64", "xxHash32",
    "xxHash64", "xxh3", "wyHash64", "murmurHash2_32", "murmurHash2_64", "murmurHash3_32", "murmurHash3_64",
    "murmurHash3_128", "gccMurmurHash", "javaHash", "hiveHash", "intHash32", "intHash64", "halfMD5", "MD5", "SHA1",
    "SHA224", "SHA256", "SHA384", "SHA512", "CRC32", "CRC32IEEE", "CRC64", "jumpConsistentHash",
    "kostikConsistentHash",
})

ARRAYS = frozenset({
    "array", "range", "arrayConcat", "arrayElement", "arrayElementOrNull", "has", "hasAll", "hasAny", "hasSubstr",
    "indexOf", "indexOfAssumeSorted", "countEqual", "arrayEnumerate", "arrayEnumerateUniq", "arrayEnumerateDense",
    "arrayEnumerateUniqRanked", "arrayEnumerateDenseRanked", "arrayPopBack", "arrayPopFront", "arrayPushBack",
    "arrayPushFront", "arrayResize", "arraySlice", "arraySort", "arrayReverseSort", "arrayPartialSort",
    "arrayPartialReverseSort", "arrayUniq", "arrayJoin", "unnest", "arrayDifference", "arrayDistinct",
    "arrayIntersect", "arrayUnion", "arraySymmetricDifference", "arrayExcept", "arrayReduce", "arrayReduceInRanges",
    "arrayReverse", "arrayFlatten", "flatten", "arrayCompact", "arrayZip", "arrayMap", "arrayFilter", "arrayFill",
    "arrayReverseFill", "arraySplit", "arrayReverseSplit", "arrayExists", "arrayAll", "arrayFirst",
    "arrayFirstOrNull", "arrayFirstIndex", "arrayLast", "arrayLastOrNull", "arrayLastIndex", "arrayMin",
    "arrayMax", "arraySum", "arrayAvg", "arrayProduct", "arrayCumSum", "arrayCumSumNonNegative", "arrayCount",
    "arrayWithConstant", "arrayRotateLeft", "arrayRotateRight", "arrayShiftLeft", "arrayShiftRight",
    "arrayAUC", "arrayROCAUC", "arrayDotProduct", "arrayFold", "arrayShuffle", "arrayRandomSample",
    "arrayJaccardIndex", "arrayLevenshteinDistance", "arrayRemove", "array_remove", "replicate",
    "emptyArrayToSingle", "emptyArrayUInt8", "emptyArrayUInt16", "emptyArrayUInt32", "emptyArrayUInt64",
    "emptyArrayInt8", "emptyArrayInt16", "emptyArrayInt32", "emptyArrayInt64", "emptyArrayFloat32",
    "emptyArrayFloat64", "emptyArrayDate", "emptyArrayDateTime", "emptyArrayString",
})

TUPLES_MAPS_AND_VECTORS = frozenset({
    "tuple", "tupleElement", "untuple", "tupleConcat", "tuplePlus", "tupleMinus", "tupleMultiply", "tupleDivide",
    "tupleNegate", "tupleMultiplyByNumber", "tupleDivideByNumber", "tupleHammingDistance", "tupleNames",
    "tupleToNameValuePairs", "flattenTuple", "dotProduct", "L1Norm", "L2Norm", "LinfNorm", "LpNorm",
    "L1Distance", "L2Distance", "L2SquaredDistance", "LinfDistance", "LpDistance", "cosineDistance",
    "L1Normalize", "L2Normalize", "LinfNormalize", "LpNormalize",
    "map", "mapKeys", "mapValues", "mapContains", "mapContainsKey", "mapFromArrays", "mapAdd", "mapSubtract",
    "mapFilter", "mapApply", "mapUpdate", "mapConcat", "mapExists", "mapAll", "mapSort", "mapReverseSort",
    "mapPopulateSeries", "extractKeyValuePairs",
})

JSON_URL_AND_NETWORK_TEXT = frozenset({
    # parse JSON held in a string column (nothing is fetched)
    "JSONHas", "JSONLength", "JSONType", "JSONKey", "JSONExtract", "JSONExtractInt", "JSONExtractUInt",
    "JSONExtractFloat", "JSONExtractBool", "JSONExtractString", "JSONExtractRaw", "JSONExtractKeys",
    "JSONExtractKeysAndValues", "JSONExtractKeysAndValuesRaw", "JSONExtractArrayRaw", "JSONArrayLength",
    "JSON_VALUE", "JSON_QUERY", "JSON_EXISTS", "isValidJSON", "toJSONString", "simpleJSONHas",
    "simpleJSONExtractInt", "simpleJSONExtractUInt", "simpleJSONExtractFloat", "simpleJSONExtractBool",
    "simpleJSONExtractString", "simpleJSONExtractRaw", "visitParamHas", "visitParamExtractInt",
    "visitParamExtractUInt", "visitParamExtractFloat", "visitParamExtractBool", "visitParamExtractString",
    "visitParamExtractRaw",
    # split URL text into parts (nothing is fetched)
    "protocol", "domain", "domainWithoutWWW", "topLevelDomain", "firstSignificantSubdomain",
    "cutToFirstSignificantSubdomain", "path", "pathFull", "queryString", "fragment", "extractURLParameter",
    "extractURLParameters", "extractURLParameterNames", "cutWWW", "cutQueryString", "cutFragment",
    "cutQueryStringAndFragment", "cutURLParameter", "URLHierarchy", "URLPathHierarchy", "netloc",
    # addresses as values
    "IPv4NumToString", "IPv4StringToNum", "IPv4NumToStringClassC", "IPv6NumToString", "IPv6StringToNum",
    "IPv4ToIPv6", "IPv4CIDRToRange", "IPv6CIDRToRange", "isIPv4String", "isIPv6String", "isIPAddressInRange",
    "cutIPv6", "MACNumToString", "MACStringToNum", "MACStringToOUI",
    # UUIDs
    "generateUUIDv4", "generateUUIDv7", "UUIDStringToNum", "UUIDNumToString",
})

BITS = frozenset({
    "bitAnd", "bitOr", "bitXor", "bitNot", "bitShiftLeft", "bitShiftRight", "bitRotateLeft", "bitRotateRight",
    "bitTest", "bitTestAll", "bitTestAny", "bitCount", "bitHammingDistance", "bitSlice", "bitmapBuild",
    "bitmapToArray", "bitmapCardinality", "bitmapContains", "bitmapHasAny", "bitmapHasAll", "bitmapAnd",
    "bitmapOr", "bitmapXor", "bitmapAndnot", "bitmapMin", "bitmapMax", "bitmapSubsetInRange", "bitmapSubsetLimit",
    "subBitmap",
})

RANDOM = frozenset({
    "rand", "rand32", "rand64", "randConstant", "randUniform", "randNormal", "randLogNormal", "randExponential",
    "randBernoulli", "randBinomial", "randPoisson", "randCanonical", "randomString", "randomFixedString",
    "randomPrintableASCII", "randomStringUTF8",
})

VALUES_AND_BLOCKS = frozenset({
    # a value or its type as it is; running values within the result
    "identity", "ignore", "materialize", "transform", "throwIf", "isConstant", "finalizeAggregation",
    "initializeAggregation", "runningDifference", "runningDifferenceStartingWithFirstValue", "runningAccumulate",
    "neighbor", "rowNumberInBlock", "rowNumberInAllBlocks", "blockNumber", "blockSize", "defaultValueOfTypeName",
    "defaultValueOfArgumentType", "greatCircleDistance", "geoDistance", "greatCircleAngle", "pointInPolygon",
    "pointInEllipses", "COLUMNS",
})

TYPE_CONSTRUCTORS = frozenset({
    # ``CAST(x AS Nullable(String))``, ``x::Decimal(10, 2)``
    "Nullable", "LowCardinality", "Array", "Tuple", "Map", "Decimal", "Decimal32", "Decimal64",
    "Decimal128", "Decimal256", "DateTime", "DateTime64", "FixedString", "Enum", "Enum8", "Enum16", "Time64",
    "Variant",
})

FUNCTIONS: frozenset[str] = (
    AGGREGATE | WINDOW | ARITHMETIC | MATH | ROUNDING | COMPARISON_AND_LOGIC | CONDITIONAL_AND_NULL | TYPE_CONVERSION
    | DATES_AND_TIMES | STRINGS | STRING_SEARCH_AND_REPLACE | ENCODING_AND_HASHING | ARRAYS | TUPLES_MAPS_AND_VECTORS
    | JSON_URL_AND_NETWORK_TEXT | BITS | RANDOM | VALUES_AND_BLOCKS | TYPE_CONSTRUCTORS
)
"""Every name free SQL may call, in the engine's spelling."""

_FUNCTIONS_LOWER = frozenset(f.lower() for f in FUNCTIONS)
_AGGREGATE_LOWER = frozenset(f.lower() for f in AGGREGATE | WINDOW)
_COMBINATORS_LOWER = tuple(sorted((c.lower() for c in AGGREGATE_COMBINATORS), key=len, reverse=True))


def is_allowed_function(name: str) -> bool:
    """Whether free SQL may call ``name`` (any case; aggregates with combinator suffixes)."""
    low = name.lower()
    if low in _FUNCTIONS_LOWER:
        return True
    return _is_combined_aggregate(low, 0)


def _is_combined_aggregate(low: str, depth: int) -> bool:
    if depth > 4:
        return False
    for c in _COMBINATORS_LOWER:
        if low.endswith(c) and len(low) > len(c):
            base = low[:-len(c)]
            if base in _AGGREGATE_LOWER or _is_combined_aggregate(base, depth + 1):
                return True
    return False
