"""``trace`` turns PyTorch's Flight Recorder on with the one variable the job's torch reads (issue 52: setting the
old and the new made every rank of a torch 2.7+ job print that the old one is deprecated)."""
from ingest.flight_recorder import env_for
from stragglerscope.trace import child_env


def test_the_variable_follows_the_torch_version():
    assert env_for("2.13.0+cpu") == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert env_for("2.7.0") == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert env_for("2.6.0+cu124") == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    assert env_for(None) == env_for("nonsense") == {"TORCH_FR_BUFFER_SIZE": "2000"}


def test_the_job_gets_one_of_them_and_a_user_s_own_setting_stands():
    env = child_env({}, base={"PATH": "/bin"})
    assert sum(k in env for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")) == 1
    mine = child_env({}, base={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"})
    assert mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in mine
