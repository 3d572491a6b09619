"""specdec.server's lifecycle as a service process runs it (in a process of its own: the
collector's state is the process's)."""

import subprocess
import sys
import textwrap

SERVE = textwrap.dedent("""
    import asyncio, gc, weakref
    from specdec.server import serve

    class Node:
        pass

    loaded, dropped = [], []

    async def load():
        loaded.append([[i] for i in range(1000)])  # what a load leaves behind
        cycle = Node()
        cycle.itself = cycle  # and a cycle it dropped, which only a collection frees
        dropped.append(weakref.ref(cycle))

    async def main():
        stops = []
        async def check():  # a background task: it starts once the service reports SERVING
            print(gc.get_freeze_count(), len(gc.get_objects()), dropped[0]() is None, flush=True)
            stops[0]()
        await serve(name="test", host="127.0.0.1", port=0, service_names=[], register=lambda server: None,
                    load=load, background=[check], on_listen=lambda port, stop: stops.append(stop), grace_s=1.0)

    asyncio.run(main())
""")


def test_what_the_load_leaves_is_frozen_out_of_the_collectors_reach_before_serving():
    done = subprocess.run([sys.executable, "-c", SERVE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, tracked, freed = done.stdout.split()
    assert int(frozen) > 1000  # the load's objects among them, never walked by a collection again
    assert int(tracked) < int(frozen) / 10  # the collector's generations hold only what serving made since
    assert freed == "True"  # the load's garbage was collected, not frozen with what it kept
