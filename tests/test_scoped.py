"""tf_gpipe.scoped: a flag that holds inside its ``with`` block, in its own thread only
(replicas trace in threads of their own), and through nested scopes."""

import threading

from tf_gpipe import scoped


def test_a_flag_holds_in_its_scope_nested_and_in_its_thread_only():
    flag = scoped.Flag()
    seen = []
    assert not flag
    with flag.scope():
        other = threading.Thread(target=lambda: seen.append(bool(flag)))
        other.start()
        other.join()
        with flag.scope():
            assert flag
        assert flag  # the inner scope's end leaves the outer one set
    assert not flag
    assert seen == [False]
