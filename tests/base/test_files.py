"""FileWatcher: when files are read again, the problem while their content is refused, the log lines, the wake-up."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from region_agent.base.files import FileWatcher
from tests.conftest import wait_for

logger = logging.getLogger("region_agent.test_files")


class RefusedError(ValueError):
    pass


def _watcher(*paths: Path) -> FileWatcher:
    return FileWatcher(*paths, what="test file", keeping="keeping the old value", logger=logger, errors=RefusedError)


def _read(path: Path) -> str:
    text = path.read_text()
    if text.startswith("bad"):
        raise RefusedError(f"{path}: {text.strip()}")
    return text


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger.name and r.levelno == level]


def test_a_refusal_is_logged_once_per_message_and_the_recovery_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=logger.name)
    path = tmp_path / "f"
    path.write_text("good")
    watch = _watcher(path)
    assert watch.read_if_due(lambda: _read(path)) == "good"
    assert watch.problems() == ()
    assert watch.read_if_due(lambda: _read(path)) is None  # unchanged: not read
    path.write_text("bad one")
    for _ in range(3):  # refused, and read again every time (the next look may succeed)
        assert watch.read_if_due(lambda: _read(path)) is None
    assert watch.problem == f"{path}: bad one"
    assert watch.problems() == (f"test file refused, keeping the old value: {path}: bad one",)
    path.write_text("bad two, longer")
    assert watch.read_if_due(lambda: _read(path)) is None
    assert watch.problem == f"{path}: bad two, longer"
    assert _messages(caplog, logging.WARNING) == [
        f"test file refused, keeping the old value: {path}: bad one",
        f"test file refused, keeping the old value: {path}: bad two, longer",
    ]
    path.write_text("good again")
    assert watch.read_if_due(lambda: _read(path)) == "good again"
    assert watch.read_if_due(lambda: _read(path)) is None
    assert watch.problems() == ()  # the problem is cleared
    assert _messages(caplog, logging.INFO) == [f"test file {path} usable again"]


def test_refused_content_is_not_read_again_until_it_changes_unless_forced(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("bad content")
    watch = _watcher(path)
    watch.mark()
    watch.refuse("the content is bad", retry=False)
    assert not watch.due()
    assert watch.problem == "the content is bad"
    assert watch.read_if_due(lambda: _read(path), forced=True) is None  # SIGHUP reads it anyway
    assert watch.problem == f"{path}: bad content"
    watch.mark()
    watch.refuse("the content is bad", retry=False)
    path.write_text("fixed")
    assert watch.due()


def test_an_unchanged_message_is_logged_again_when_forced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=logger.name)
    watch = FileWatcher(tmp_path / "f", what="zone", keeping="serving the old one", logger=logger,
                        level=logging.ERROR)
    watch.refuse("broken", reason="yaml")
    watch.refuse("broken", reason="yaml")
    watch.refuse("broken", reason="yaml", again=True)
    assert _messages(caplog, logging.ERROR) == ["zone refused (yaml), serving the old one: broken"] * 2


def test_the_signature_covers_every_path(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_text("a")
    second.write_text("b")
    watch = _watcher(first, second)
    assert watch.read_if_due(lambda: _read(first) + _read(second)) == "ab"
    assert not watch.due()
    second.write_text("b, rotated")
    assert watch.due()
    assert watch.read_if_due(lambda: _read(first) + _read(second)) == "ab, rotated"
    second.unlink()  # a missing file is a change too
    assert watch.due()


def test_a_failed_first_read_raises_and_keeps_no_signature(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("bad at start")
    watch = _watcher(path)
    with pytest.raises(RefusedError, match="bad at start"):
        watch.read_now(lambda: _read(path))
    assert watch.due() and watch.problem is None  # nothing was in use, so nothing is kept


async def test_run_polls_and_a_wake_up_forces_a_check_at_once(tmp_path: Path) -> None:
    watch = _watcher(tmp_path / "f")
    calls: list[bool] = []

    async def check(forced: bool) -> None:
        await asyncio.sleep(0)
        calls.append(forced)

    task = asyncio.create_task(watch.run(check, 60.0))
    try:
        await asyncio.sleep(0)
        assert calls == []
        watch.request_reload()
        await wait_for(lambda: calls == [True], timeout=5, message="forced check")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    polled: list[bool] = []
    task = asyncio.create_task(watch.run(polled.append, 0.01))  # a plain function works too
    try:
        await wait_for(lambda: len(polled) >= 2, timeout=5, message="polls")
        assert not any(polled)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
