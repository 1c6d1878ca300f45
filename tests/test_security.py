"""Strangers are refused, and malformed control messages change nothing, on one real PD stack
started with an API key and mutual TLS (`pdflash up --api-key K --tls-cert/--tls-key/--tls-ca`):

- the router answers 401 (OpenAI error shape) without the key on every route but /health and
  /openapi.json, and the official `openai` client with the key gets a completion, which also
  crossed router -> P/D, D -> P and P -> D over mutual TLS;
- P and D refuse a peer with no certificate or one from another CA;
- D takes TransferDone only from the P it bootstrapped: the test holds a certificate and plays
  P itself (D bootstraps it), so it knows the room's token and can show that a wrong one, a
  forged ack and a duplicate are refused and leave the room as it was;
- malformed Prefill, Bootstrap and Generate messages get INVALID_ARGUMENT, unknown rooms
  NOT_FOUND; afterwards every page is free and a request still succeeds."""
from __future__ import annotations

import datetime
import ipaddress
import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import requests
from pd_stack import Stack, running

from common.service.tls import Tls
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

API_KEY = "sk-test-" + "7" * 24
VOCAB = 49152  # the embedded model's
PROMPT = [1, 504, 3458, 282, 4649, 314]


# ---- a throwaway CA and certificates ----------------------------------------------------------

@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


def _issue(name: str, issuer: Pem | None, ca: bool) -> Pem:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    if issuer is None:
        issuer_name, signer = subject, key
    else:
        issuer_name = x509.load_pem_x509_certificate(issuer.cert).subject
        signer = serialization.load_pem_private_key(issuer.key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:  # one certificate per service, used as server and as client
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = builder.sign(signer, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM),
               key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    ca = _issue("pdflash test CA", None, ca=True)
    service = _issue("pdflash service", ca, ca=False)
    rogue_ca = _issue("someone else's CA", None, ca=True)
    rogue = _issue("pdflash service", rogue_ca, ca=False)
    d = tmp_path_factory.mktemp("pki")
    files = {"ca": ca.cert, "cert": service.cert, "key": service.key, "rogue_cert": rogue.cert, "rogue_key": rogue.key}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: d / f"{name}.pem" for name in files}


@pytest.fixture(scope="module")
def tls(pki) -> Tls:
    return Tls(pki["cert"].read_bytes(), pki["key"].read_bytes(), pki["ca"].read_bytes())


@pytest.fixture(scope="module")
def stack(pki) -> Iterator[Stack]:
    from conftest import SHARED_STACK_ARGS

    with running("--mode", "pd", "--api-key", API_KEY, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]),
                 "--tls-ca", str(pki["ca"]), *SHARED_STACK_ARGS) as s:
        yield s


def channel(addr: str, tls: Tls) -> grpc.Channel:
    return grpc.secure_channel(addr, tls.channel_credentials())


# ---- the router's API key ---------------------------------------------------------------------

@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/server_info"), ("GET", "/metrics"),
                                          ("POST", "/generate"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")])
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", API_KEY, f"Basic {API_KEY}"])
def test_every_route_but_health_needs_the_key(stack: Stack, method: str, path: str, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    resp = requests.request(method, stack.url + path, headers=headers, json={"text": "hi"}, timeout=30)
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["type"] == "authentication_error"
    assert "Authorization: Bearer" in resp.json()["error"]["message"]


def test_health_is_open_and_the_key_opens_the_rest(stack: Stack) -> None:
    assert requests.get(stack.url + "/health", timeout=30).status_code == 200
    doc = requests.get(stack.url + "/openapi.json", timeout=30).json()  # open too, and says who needs the key
    assert doc["paths"]["/generate"]["post"]["security"] == [{"bearer": []}]
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"] and "security" not in doc["paths"]["/openapi.json"]["get"]
    assert requests.get(stack.url + "/v1/models", headers=stack.headers, timeout=30).status_code == 200


def test_openai_client_with_the_key(stack: Stack) -> None:
    """A real completion through router, P and D, every hop over mutual TLS."""
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 4
    room = out.id.removeprefix("cmpl-")  # 128 random bits, not a counter or a clock
    assert len(room) == 32 and int(room, 16) >= 0


def test_router_grpc_needs_the_key(stack: Stack) -> None:
    req = pb.RouterGenerateRequest(input_ids=PROMPT, sampling=pb.SamplingParams(max_new_tokens=2))
    with grpc.insecure_channel(f"127.0.0.1:{stack.port + 1}") as ch:
        stub = pb_grpc.RouterServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks = list(stub.Generate(req, timeout=120, metadata=[("authorization", f"Bearer {API_KEY}")]))
        assert sum(len(c.token_ids) for c in chunks) == 2


# ---- mutual TLS -------------------------------------------------------------------------------

def test_peers_without_a_good_certificate_are_refused(stack: Stack, pki, tls: Tls) -> None:
    rogue = Tls(pki["rogue_cert"].read_bytes(), pki["rogue_key"].read_bytes(), pki["ca"].read_bytes())
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=tls.ca)
    for w in stack.workers:
        for make in (lambda: grpc.insecure_channel(w.addr), lambda: grpc.secure_channel(w.addr, no_client_cert),
                     lambda: channel(w.addr, rogue)):
            with make() as ch, pytest.raises(grpc.RpcError) as info:
                w.stub(ch).Health(pb.HealthRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (w, info.value)
        with channel(w.addr, tls) as ch:
            assert w.stub(ch).Health(pb.HealthRequest(), timeout=10).ok


# ---- D takes TransferDone only from the P it bootstrapped ---------------------------------------

class PlayedPrefill(pb_grpc.PrefillServiceServicer):
    """The test's own P (with a good certificate): D bootstraps it, so the test learns the room's token."""

    def __init__(self):
        self.boots: queue.Queue[pb.BootstrapRequest] = queue.Queue()

    def Bootstrap(self, request, context):
        self.boots.put(request)
        return pb.BootstrapReply(ok=True)

    def Abort(self, request, context):
        return pb.AbortReply(found=True)


@pytest.fixture(scope="module")
def played_prefill(tls: Tls) -> Iterator[tuple[str, PlayedPrefill]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = PlayedPrefill()
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_transfer_done_only_from_the_bootstrapped_prefill(stack: Stack, tls: Tls, played_prefill) -> None:
    addr, played = played_prefill
    decode = stack.worker("decode")
    room = "security-room-1"
    with channel(decode.addr, tls) as ch:
        stub = pb_grpc.DecodeServiceStub(ch)
        free_before = decode.health().free_pages
        stream = stub.Generate(pb.GenerateRequest(room=room, input_ids=PROMPT, prefill_addr=addr, deadline_s=60,
                                                  sampling=pb.SamplingParams(max_new_tokens=4)), timeout=90)
        chunks: list = []
        reader = threading.Thread(target=lambda: _drain(stream, chunks), daemon=True)
        reader.start()
        boot = played.boots.get(timeout=60)
        assert boot.room == room and len(boot.transfer_token) == 32
        assert decode.health().free_pages < free_before  # the room's pages are reserved

        def done(**fields) -> pb.TransferDoneRequest:
            return pb.TransferDoneRequest(**({"room": room, "ok": True, "first_token": 42,
                                              "prompt_tokens": len(PROMPT)} | fields))

        # Anyone else, however well-formed its ack, is refused; the room goes on waiting.
        assert _code(lambda: stub.TransferDone(done(), timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: stub.TransferDone(done(transfer_token="0" * 32), timeout=10)) \
            == grpc.StatusCode.PERMISSION_DENIED
        # Even the token's holder cannot claim a token outside the vocabulary or another prompt length.
        for bad in (done(first_token=VOCAB), done(first_token=-1), done(prompt_tokens=10**6)):
            bad.transfer_token = boot.transfer_token
            assert _code(lambda: stub.TransferDone(bad, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.TransferDone(done(room="no-such-room"), timeout=10)) == grpc.StatusCode.NOT_FOUND
        assert not chunks and reader.is_alive()
        # The bootstrapped P's word is taken, once.
        failed = done(ok=False, error="played prefill gives up", transfer_token=boot.transfer_token)
        assert stub.TransferDone(failed, timeout=10).ok
        assert _code(lambda: stub.TransferDone(failed, timeout=10)) == grpc.StatusCode.NOT_FOUND
        reader.join(30)
        assert len(chunks) == 1 and isinstance(chunks[0], grpc.RpcError), chunks
        assert "played prefill gives up" in chunks[0].details()
    stack.wait_all_pages_free()


def _drain(stream, out: list) -> None:
    try:
        out.extend(stream)
    except grpc.RpcError as e:
        out.append(e)


# ---- malformed control messages ---------------------------------------------------------------

def _bootstrap_cases(good: pb.BootstrapRequest) -> dict[str, pb.BootstrapRequest]:
    def mutate(change: Callable[[pb.BootstrapRequest], object]) -> pb.BootstrapRequest:
        msg = pb.BootstrapRequest()
        msg.CopyFrom(good)
        change(msg)
        return msg

    kv = 0  # the target KV buffer of rank 0, in both the single-rank fields and `ranks`

    def both(change: Callable[[pb.BufferInfo], object]) -> Callable[[pb.BootstrapRequest], None]:
        return lambda m: (change(m.buffers[kv]), change(m.ranks[0].buffers[kv]))

    return {
        "page id past the buffer": mutate(both(lambda b: b.indices.append(b.num_pages))),
        "page id at 2**32-1": mutate(both(lambda b: b.indices.append(2**32 - 1))),
        "buffer past the address space": mutate(both(lambda b: setattr(b, "base_addr", 2**64 - 4096))),
        "length that contradicts the shape": mutate(both(lambda b: setattr(b, "length", b.length * 3))),
        "pages that overflow the length": mutate(both(lambda b: setattr(b, "num_pages", 2**32 - 1))),
        "zero bytes per page": mutate(both(lambda b: setattr(b, "bytes_per_page", 0))),
        "unknown buffer kind": mutate(both(lambda b: setattr(b, "kind", "raw_memory"))),
        "unknown dtype": mutate(both(lambda b: setattr(b, "dtype", "int4"))),
        "rank past the TP size": mutate(lambda m: setattr(m.ranks[0], "tp_rank", 7)),
        "rank without a session": mutate(lambda m: setattr(m.ranks[0], "session_id", "")),
        "no room": mutate(lambda m: setattr(m, "room", "")),
        "huge room id": mutate(lambda m: setattr(m, "room", "r" * 100_000)),
        "decode_addr not host:port": mutate(lambda m: setattr(m, "decode_addr", "evil")),
        "decode_addr port out of range": mutate(lambda m: setattr(m, "decode_addr", "127.0.0.1:99999")),
    }


def _sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**({"max_new_tokens": 4} | fields))


GOOD_REQUEST = {"room": "fuzz-room", "input_ids": PROMPT, "sampling": _sampling(), "deadline_s": 30}


def _request_cases(kind: type) -> dict[str, object]:
    """Malformed PrefillRequest / GenerateRequest messages (the fields both have), each GOOD_REQUEST
    with one field changed."""

    def msg(**fields):
        return kind(**(GOOD_REQUEST | fields))

    return {
        "no room": msg(room=""),
        "huge room id": msg(room="r" * 10_000),
        "empty prompt": msg(input_ids=[]),
        "token id past the vocabulary": msg(input_ids=[*PROMPT, VOCAB]),
        "negative token id": msg(input_ids=[-1]),
        "int32 max token id": msg(input_ids=[2**31 - 1]),
        "prompt longer than the context": msg(input_ids=[1] * 9000),
        "zero new tokens": msg(sampling=_sampling(max_new_tokens=0)),
        "negative new tokens": msg(sampling=_sampling(max_new_tokens=-5)),
        "int32 max new tokens": msg(sampling=_sampling(max_new_tokens=2**31 - 1)),
        "NaN temperature": msg(sampling=_sampling(temperature=math.nan)),
        "negative temperature": msg(sampling=_sampling(temperature=-1)),
        "top_p above 1": msg(sampling=_sampling(top_p=2)),
        "negative top_k": msg(sampling=_sampling(top_k=-3)),
        "stop token past the vocabulary": msg(sampling=_sampling(stop_token_ids=[VOCAB + 1])),
        "negative deadline": msg(deadline_s=-1),
        "NaN deadline": msg(deadline_s=math.nan),
        "infinite deadline": msg(deadline_s=math.inf),
        "huge deadline": msg(deadline_s=1e300),
    }


def test_malformed_control_messages_change_nothing(stack: Stack, tls: Tls, played_prefill) -> None:
    addr, played = played_prefill
    prefill, decode = stack.worker("prefill"), stack.worker("decode")
    with channel(prefill.addr, tls) as p_ch, channel(decode.addr, tls) as d_ch:
        p, d = pb_grpc.PrefillServiceStub(p_ch), pb_grpc.DecodeServiceStub(d_ch)
        # A real bootstrap to mutate: D sends one to the played P, which then fails the room.
        stream = d.Generate(pb.GenerateRequest(room="fuzz-template", input_ids=PROMPT, prefill_addr=addr,
                                               sampling=_sampling(), deadline_s=60), timeout=90)
        boot = played.boots.get(timeout=60)
        d.TransferDone(pb.TransferDoneRequest(room=boot.room, ok=False, error="template taken",
                                              transfer_token=boot.transfer_token), timeout=10)
        with pytest.raises(grpc.RpcError):
            list(stream)
        stack.wait_all_pages_free()
        free = stack.pools()

        wrong = {}
        for name, msg in _bootstrap_cases(boot).items():
            wrong[f"Bootstrap: {name}"] = _code(lambda: p.Bootstrap(msg, timeout=10))
        for name, msg in _request_cases(pb.PrefillRequest).items():
            msg.decode_addr = decode.addr
            wrong[f"Prefill: {name}"] = _code(lambda: p.Prefill(msg, timeout=10))
        wrong["Prefill: decode_addr not host:port"] = _code(lambda: p.Prefill(pb.PrefillRequest(
            room="fuzz-room", input_ids=PROMPT, sampling=_sampling(), decode_addr="nowhere"), timeout=10))
        for name, msg in _request_cases(pb.GenerateRequest).items():
            msg.prefill_addr = prefill.addr
            wrong[f"Generate: {name}"] = _code(lambda: list(d.Generate(msg, timeout=10)))
        wrong["Generate: prefill_addr not host:port"] = _code(lambda: list(d.Generate(pb.GenerateRequest(
            room="fuzz-room", input_ids=PROMPT, sampling=_sampling(), prefill_addr="a:b:c"), timeout=10)))
        wrong["TransferDone: unknown room"] = _code(lambda: d.TransferDone(
            pb.TransferDoneRequest(room="fuzz-room", ok=True, first_token=1), timeout=10))
        expected = {name: grpc.StatusCode.NOT_FOUND if "unknown room" in name else grpc.StatusCode.INVALID_ARGUMENT
                    for name in wrong}
        assert wrong == expected

        # Nothing was reserved, queued or written.
        assert stack.pools() == free
        assert played.boots.empty()

        # The negative control: the messages the cases change one field of are taken as they are
        # (so each refusal above is its field's), and both services go on serving.
        template = pb.BootstrapRequest()
        template.CopyFrom(boot)
        template.room = "fuzz-template-2"  # dropped after P's bootstrap TTL: no Prefill claims it
        assert p.Bootstrap(template, timeout=10).ok
        with futures.ThreadPoolExecutor(1) as pool:
            prefilled = pool.submit(p.Prefill, pb.PrefillRequest(**GOOD_REQUEST, decode_addr=decode.addr), timeout=60)
            chunks = list(d.Generate(pb.GenerateRequest(**GOOD_REQUEST, prefill_addr=prefill.addr), timeout=60))
            assert prefilled.result().ok
        assert sum(len(c.token_ids) for c in chunks) == 4 and chunks[-1].finished, chunks
    stack.wait_all_pages_free()
