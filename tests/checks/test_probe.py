"""Which probe failures are about the target and which about this process."""

from __future__ import annotations

import errno

import pytest

from region_agent.checks.probe import Outcome, _os_error_result


@pytest.mark.parametrize(("code", "outcome"), [
    (errno.EMFILE, Outcome.LOCAL_ERROR), (errno.ENFILE, Outcome.LOCAL_ERROR), (errno.ENOBUFS, Outcome.LOCAL_ERROR),
    (errno.ENOMEM, Outcome.LOCAL_ERROR), (errno.EADDRNOTAVAIL, Outcome.LOCAL_ERROR),
    (errno.ECONNREFUSED, Outcome.DOWN), (errno.EHOSTUNREACH, Outcome.DOWN), (errno.ECONNRESET, Outcome.DOWN),
    (None, Outcome.DOWN),
])
def test_errno_decides_whose_failure_it_is(code: int | None, outcome: Outcome) -> None:
    error = OSError(code, "x") if code is not None else OSError("no errno")
    assert _os_error_result(error, "connect: ").outcome is outcome
