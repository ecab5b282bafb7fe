"""The KV service under internal mutual TLS: plaintext and certificate-less clients are refused,
a sender with a node certificate of the configured CA ships bit-exact KV."""

from __future__ import annotations

import grpc
import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache
from tls_support import handshake_code, make_certs

from kv_transfer import (FailedSide, KVPiece, SimpleBlockPool, TransferSettings, TransferStatus, make_receiver,
                         make_sender)
from proto.internal_auth import InternalTLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def node_tls(certs, name: str = "node") -> InternalTLS:
    return InternalTLS(str(certs / f"{name}.pem"), str(certs / f"{name}.key"), str(certs / "ca.pem"))


def _handshake_code(endpoint: str, layout, channel: grpc.Channel) -> grpc.StatusCode:
    return handshake_code(channel, layout, TOKEN, "none")


def test_plaintext_client_is_refused_and_mutual_tls_transfers(layout, certs):
    settings = TransferSettings(transport="grpc", codec="none", token=TOKEN, tls=node_tls(certs))
    pool = SimpleBlockPool(16)
    dst = torch.zeros(layout.cache_shape(16), dtype=layout.dtype)
    receiver = make_receiver(settings, layout, dst, pool)
    senders = []
    try:
        endpoint = receiver.endpoint
        assert endpoint.startswith("127.0.0.1:")
        ca = (certs / "ca.pem").read_bytes()
        refused = {
            "plaintext": grpc.insecure_channel(endpoint),
            "no client certificate": grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(ca)),
            "certificate of another CA": grpc.secure_channel(endpoint, node_tls(certs, "rogue").channel_credentials()),
        }
        for what, channel in refused.items():
            assert _handshake_code(endpoint, layout, channel) == grpc.StatusCode.UNAVAILABLE, what
        assert _handshake_code(endpoint, layout, grpc.secure_channel(endpoint, node_tls(certs).channel_credentials())) \
            == grpc.StatusCode.OK

        src = random_cache(layout, 4)
        plain = make_sender("grpc", layout, codec="none", token=TOKEN)
        senders.append(plain)
        handle = plain.send(KVPiece("plain", src, [0, 1]), endpoint)
        assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle

        sender = make_sender(settings, layout)          # the node certificate, as a client
        senders.append(sender)
        handle = sender.send(KVPiece("tls", src, [2, 0, 3], num_tokens=9), endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        result = receiver.wait(handle.transfer_id, 10)
        assert result.status == TransferStatus.DONE and result.num_tokens == 9
        assert torch.equal(dst[:, result.dst_block_ids], src[:, [2, 0, 3]])
        assert receiver.stats.auth_failures == 0
        assert_no_leak(pool, result.dst_block_ids)
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
