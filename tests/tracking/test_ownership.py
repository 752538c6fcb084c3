"""Who owns a run: a live process, a dead one, a recycled pid, another host."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchlab.tracking import ownership


def test_owner_is_alive_while_its_process_runs() -> None:
    assert ownership.owner_gone(ownership.owner_tags()) is None


@pytest.mark.integration
def test_owner_is_gone_once_its_process_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tags = ownership.owner_tags(child.pid)
    assert ownership.owner_gone(tags) is None
    child.kill()
    child.wait()
    assert (
        ownership.owner_gone(tags)
        == f"owner pid {child.pid} on {tags[ownership.HOST]} exited without ending the run (killed?)"
    )


def test_a_recycled_pid_is_not_the_owner() -> None:
    tags = {**ownership.owner_tags(), ownership.STARTED: "1000000000.00"}  # this pid, another start time
    assert "the pid was reused since" in str(ownership.owner_gone(tags))


def test_owners_on_other_hosts_are_never_judged() -> None:
    tags = {ownership.HOST: "elsewhere.invalid", ownership.PID: str(2**22 + 7), ownership.STARTED: "1.00"}
    assert ownership.owner_gone(tags) is None
    assert ownership.owner_gone({}) is None  # runs opened by something else than batchlab
