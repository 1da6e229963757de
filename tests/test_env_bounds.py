"""Every numeric setting read from the environment is finite and bounded (issue 32, item 5): a bad
value is one clear error naming the variable and the range, never a silent default and never an
unbounded wait (``AOTBUILD_LOCK_TIMEOUT=inf`` waited forever for a held lock)."""

from __future__ import annotations

import pytest

from aotbuild import constants
from aotbuild.errors import UsageError
from tests.conftest import TINY_DICT, invoke_cli

BAD = ["inf", "-inf", "nan", "1e400", "-1", "10s", "5\n\x1b[2J"]


@pytest.mark.parametrize("value", BAD)
def test_a_lock_timeout_that_is_not_a_finite_number_in_range_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(constants.ENV_LOCK_TIMEOUT, value)
    with pytest.raises(UsageError) as err:
        constants.lock_timeout()
    message = str(err.value)
    assert message.startswith("AOTBUILD_LOCK_TIMEOUT=") and "from 0 to 86400" in message
    assert "\n" not in message and "\x1b" not in message  # the value is shown escaped


@pytest.mark.parametrize("value,expected", [("0", 0.0), ("2.5", 2.5), ("86400", 86400.0), (" 7 ", 7.0)])
def test_a_lock_timeout_in_range_is_used(monkeypatch, value, expected):
    monkeypatch.setenv(constants.ENV_LOCK_TIMEOUT, value)
    assert constants.lock_timeout() == expected
    monkeypatch.setenv(constants.ENV_LOCK_TIMEOUT, "86401")
    with pytest.raises(UsageError, match="86400"):
        constants.lock_timeout()


def test_unset_or_empty_means_the_default(monkeypatch):
    monkeypatch.delenv(constants.ENV_LOCK_TIMEOUT, raising=False)
    assert constants.lock_timeout() == constants.DEFAULT_LOCK_TIMEOUT
    monkeypatch.setenv(constants.ENV_LOCK_TIMEOUT, "")
    assert constants.lock_timeout() == constants.DEFAULT_LOCK_TIMEOUT
    for name, (variable, default) in constants.LIMITS.items():
        monkeypatch.setenv(variable, "")
        assert constants.limit(name) == default


@pytest.mark.parametrize("name", sorted(constants.LIMITS))
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-3", "1.5", "1e3", "abc", str(2 ** 63)])
def test_every_limit_refuses_what_is_not_a_positive_integer_in_range(monkeypatch, name, value):
    variable = constants.LIMITS[name][0]
    monkeypatch.setenv(variable, value)
    with pytest.raises(UsageError) as err:
        constants.limit(name)
    assert str(err.value).startswith(f"{variable}=") and "an integer from 1 to" in str(err.value)


def test_a_limit_in_range_is_used_and_a_job_time_limit_is_at_most_a_week(monkeypatch):
    monkeypatch.setenv("AOTBUILD_MAX_STEPS", "500")
    assert constants.limit("steps") == 500
    monkeypatch.setenv("AOTBUILD_JOB_TIMEOUT", str(7 * 86400))
    assert constants.limit("job_seconds") == 7 * 86400
    monkeypatch.setenv("AOTBUILD_JOB_TIMEOUT", str(7 * 86400 + 1))
    with pytest.raises(UsageError, match="AOTBUILD_JOB_TIMEOUT=604801: must be an integer from 1 to 604800"):
        constants.limit("job_seconds")


def test_a_lock_never_waits_on_an_infinite_timeout(tmp_path, monkeypatch):
    """Where the value is used: the lock refuses it before waiting (it waited forever when held)."""
    from aotbuild.cache.locks import flocked

    monkeypatch.setenv(constants.ENV_LOCK_TIMEOUT, "inf")
    with pytest.raises(UsageError, match="AOTBUILD_LOCK_TIMEOUT=inf"):
        with flocked(tmp_path / "lock", exclusive=True):
            pass


def test_the_cli_says_which_variable_is_wrong_in_one_line(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(repr(TINY_DICT).replace("'", '"').replace("True", "true").replace("False", "false"))
    monkeypatch.setenv("AOTBUILD_MAX_STEPS", "inf")  # was read as "unset": the default bound, silently
    result = invoke_cli("plan", "--cache", str(tmp_path / "cache"), str(recipe))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "AOTBUILD_MAX_STEPS" in line]
    assert lines and "AOTBUILD_MAX_STEPS=inf: must be an integer from 1 to" in lines[0], result.stderr
