"""pytree_ckpt/phase.py: the rebuilding() flag."""

from __future__ import annotations

from pytree_ckpt.phase import REBUILDING, rebuilding


def test_a_rebuild_nested_in_another_restores_the_outer_rebuilds_flag_as_it_ends() -> None:
    # Guards against (helper LO, mutation of phase.rebuilding: REBUILDING reset to False, not
    # to the value it had): an inner rebuild ending inside an outer one turned the flag off for
    # the rest of the outer rebuild, where a window or an offloaded boundary would open again
    # (NOTE [a discard's rebuild opens no window]).
    assert REBUILDING.get() is False
    with rebuilding():
        with rebuilding():
            assert REBUILDING.get() is True
        assert REBUILDING.get() is True
    assert REBUILDING.get() is False
