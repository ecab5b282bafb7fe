"""BaseSender: after a piece ends, the sender holds no reference to the prefill cache."""

from __future__ import annotations

import gc
import weakref

from kv_helpers import random_cache, wait_for

from kv_transfer import TransferStatus


def test_sender_drops_the_cache_after_done(make_pair, layout):
    pair = make_pair("grpc", layout)
    src = random_cache(layout, 4)
    ref = weakref.ref(src)
    assert pair.sender.send("r", src, [1, 3], pair.dest).wait(10) == TransferStatus.DONE
    del src
    gc.collect()
    assert wait_for(lambda: ref() is None, 2), "sender still holds the prefill cache"
