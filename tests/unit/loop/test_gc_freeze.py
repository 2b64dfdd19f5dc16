"""The driver freezes its start-up heap before the loop (mlrl.jobs.rl.freeze_startup_heap): what
start-up allocated moves to the permanent generation (full collections stop traversing it), and
garbage made afterwards, the per-step objects, is still collected."""

import subprocess
import sys
import textwrap


def test_startup_objects_frozen_and_later_cycles_still_collected():
    code = textwrap.dedent("""
        import gc, weakref
        from mlrl.jobs.rl import freeze_startup_heap

        class Node:
            pass

        startup = [[i] for i in range(50_000)]  # long-lived start-up state
        assert gc.get_freeze_count() == 0
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= 50_000, frozen
        tracked = [len(gc.get_objects(generation=g)) for g in (0, 1, 2)]
        assert all(n < 1000 for n in tracked), tracked

        a, b = Node(), Node()  # a reference cycle made after start-up, i.e. per-step garbage
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        gc.collect()
        assert alive() is None, "a cycle made after the freeze was not collected"
        assert gc.get_freeze_count() == frozen
        print("ok", frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
