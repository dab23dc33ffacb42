"""The schedule `make test-all` runs holds every kind of fault docs/reliability.md lists (cheap: no run)."""

import pytest

from tests.chaos.schedules import FAULT_KINDS, fault_kinds, make_schedule
from tests.chaos.test_chaos import CI_SEED

pytestmark = pytest.mark.timeout(30)


def test_the_ci_schedule_holds_every_kind_of_fault():
    schedule = make_schedule(CI_SEED)
    assert fault_kinds(schedule) == set(FAULT_KINDS), schedule
    # Its first damage lands before a run that still has shards to finish (not the final one).
    assert schedule[1].damage_before == "flip_part_byte", schedule


def test_schedules_are_reproducible_from_their_seed():
    assert make_schedule(7) == make_schedule(7)
