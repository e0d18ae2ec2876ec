"""The suite's guard (`conftest.no_unexpected_tracebacks` / `module_garbage`) still catches what it is for
with the objects made before each test frozen: a task dropped with its exception unretrieved (held in a
reference cycle, so only a collection finds it) fails the test that dropped it, inside that test; a
declared one passes; a cycle made before the tests and dropped by a test fails the module's last test
(the one difference the freezing makes: such garbage is found at the module's end)."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

DROP = """
import asyncio


def drop_in_a_cycle(task):
    cycle = [task]
    cycle.append(cycle)  # only the garbage collector frees it: no refcount does


def failed_task():
    async def boom():
        raise RuntimeError("boom")

    loop = asyncio.new_event_loop()
    task = loop.create_task(boom())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()
    return task
"""

IN_TEST = """
import pytest
from drop import drop_in_a_cycle, failed_task


def test_drops_a_failed_task():
    drop_in_a_cycle(failed_task())


@pytest.mark.expected_errors("never retrieved")
def test_declares_it():
    drop_in_a_cycle(failed_task())


def test_clean():
    assert True
"""

MODULE_END = """
from drop import failed_task

CYCLE = [failed_task()]
CYCLE.append(CYCLE)  # made before the tests (frozen while they run), freed only by a collection
HOLDER = [CYCLE]
del CYCLE


def test_drops_what_the_module_made():
    HOLDER.clear()  # garbage made of frozen objects: the module's end collects it


def test_last():
    assert True
"""


def test_dropped_failed_tasks_fail_the_test_or_the_module_that_dropped_them(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(drop=DROP, test_in_test=IN_TEST, test_module_end=MODULE_END)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=5, errors=2)  # the guard fails a test in its teardown
    result.stdout.fnmatch_lines_random(
        [
            "ERROR test_in_test.py::test_drops_a_failed_task - Failed: 1 unexpected error*",
            "ERROR test_module_end.py::test_last - Failed: unretrieved task exception*",
        ]
    )
