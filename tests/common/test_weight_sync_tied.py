"""Tied weights travel once: real tiny Qwen2 models over a real loopback gRPC server.

The session's tiny policy ties `lm_head.weight` to `model.embed_tokens.weight`; its manifest
lists the second name as an alias (no bytes), the stream and its checksum carry the storage
once, and the client hands back both names as one tensor, so loading the fetched dict into a
fresh model gives the source model's logits exactly. An untied model travels as before.
"""

from __future__ import annotations

import gc

import pytest
import torch
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import WeightSyncClient, WeightSyncError, WeightSyncServer, wire
from services.common.weight_sync.aliases import AliasFinder
from services.common.weight_sync.client import _check_complete
from services.rollout.vllm_worker import WorkerWeightLoader

torch.set_num_threads(1)
CHUNK = 64 << 10
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
SENT_METRIC = "forage_weight_sync_bytes_sent_total"  # data chunks the server streamed


@pytest.fixture()
def server():
    srv = WeightSyncServer(chunk_bytes=CHUNK).start()
    yield srv
    srv.stop(0)


def _fetch(srv: WeightSyncServer) -> dict[str, torch.Tensor]:
    with WeightSyncClient(srv.address, timeout_s=10, fetch_timeout_s=30) as client:
        _, tensors = client.fetch()
    return tensors


def _wire_bytes(srv: WeightSyncServer, source: dict[str, torch.Tensor], version: int
                ) -> tuple[pb.Manifest, dict[str, torch.Tensor], int]:
    """Publish `source`, fetch it; (manifest, fetched tensors, data-chunk bytes streamed)."""
    before = REGISTRY.get_sample_value(SENT_METRIC) or 0.0
    manifest = srv.publish(source, version=version)
    tensors = _fetch(srv)
    after = REGISTRY.get_sample_value(SENT_METRIC)
    return manifest, tensors, int(after - before)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _fresh_copy_of(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A new model of the same config (its own random weights) loaded strictly from `tensors`."""
    torch.manual_seed(123)
    fresh = type(model)(model.config).eval()
    assert not torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    fresh.load_state_dict(tensors, strict=True)
    return fresh


def test_tied_model_sends_its_embedding_once(server, tiny_policy_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    source = model.state_dict()  # both names, one storage
    embed_bytes = source[EMBED].numel() * source[EMBED].element_size()
    # The same weights with the tie broken: what every publish streamed before.
    untied = {**source, HEAD: source[HEAD].clone()}
    untied_manifest, _, untied_wire = _wire_bytes(server, untied, version=1)

    manifest, tensors, on_wire = _wire_bytes(server, source, version=2)

    specs = {spec.name: spec for spec in manifest.tensors}
    assert list(specs) == list(source)  # every name is listed
    assert {name: spec.alias_of for name, spec in specs.items() if spec.alias_of} == {HEAD: EMBED}
    assert specs[HEAD].nbytes == 0 and specs[HEAD].offset == specs[EMBED].offset
    assert untied_manifest.total_bytes == _nbytes(source)
    assert manifest.total_bytes == untied_manifest.total_bytes - embed_bytes
    # Data chunks on the wire: the stream plus a few bytes of framing per chunk.
    assert abs((untied_wire - on_wire) - embed_bytes) <= 64 * -(-embed_bytes // CHUNK)
    print(f"\ntied tiny policy: {manifest.total_bytes} stream bytes ({on_wire} on the wire) "
          f"vs {untied_manifest.total_bytes} ({untied_wire}) untied; embedding {embed_bytes}")
    assert list(tensors) == list(source)  # the names every consumer saw before
    assert tensors[HEAD] is tensors[EMBED]
    for name, tensor in source.items():
        assert torch.equal(tensors[name], tensor), name
    assert torch.equal(_logits(_fresh_copy_of(model, tensors)), _logits(model))


def test_untied_model_is_sent_whole(server):
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    source = model.state_dict()
    assert source[HEAD].data_ptr() != source[EMBED].data_ptr()

    manifest = server.publish(source, version=1)
    tensors = _fetch(server)

    assert not any(spec.alias_of for spec in manifest.tensors)
    assert manifest.total_bytes == _nbytes(source)
    assert list(tensors) == list(source)
    assert tensors[HEAD] is not tensors[EMBED]
    for name, tensor in source.items():
        assert torch.equal(tensors[name], tensor), name
    assert torch.equal(_logits(_fresh_copy_of(model, tensors)), _logits(model))


def test_vllm_worker_loads_every_name_of_a_tied_model(server, tiny_policy_dir):
    source = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).state_dict()
    server.publish(source, version=4)
    loader = WorkerWeightLoader(rank=0)
    loaded: list[str] = []
    try:
        assert loader.stage(4, server.address)["ok"]
        assert loader.commit(4, lambda weights: loaded.extend(n for n, _ in weights))["ok"]
    finally:
        loader.close()
    assert loaded == list(source)


def test_only_exact_aliases_of_live_tensors_are_merged(server):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    source = {
        "w": base,
        "w.same": base.view(4, 6),  # another tensor object on exactly this memory: an alias
        "w.rows": base[:2],  # overlaps, not the same tensor: sent
        "w.t": base.t(),  # same memory, other strides: sent
        "w.int": base.view(torch.int32),  # same bytes, other dtype: sent
        "empty": torch.empty(0, 6),
        "empty.again": torch.empty(0, 6),
    }
    manifest = server.publish(source, version=1)
    assert {s.name: s.alias_of for s in manifest.tensors if s.alias_of} == {"w.same": "w"}
    tensors = _fetch(server)
    assert list(tensors) == list(source)
    for name, tensor in source.items():
        assert torch.equal(tensors[name], tensor), name


def test_a_dead_or_moved_tensor_is_never_an_alias_target():
    """An iterable publish frees each tensor after copying it, and the next one of the same
    shape may land on the same address: only a tensor still alive, on the memory it was seen
    on, may be aliased."""
    finder = AliasFinder()
    pool = torch.zeros(2000)
    first = pool[:1000]
    assert finder.seen("a", first) is None
    assert finder.seen("a.tied", first.view(1000)) == "a"  # alive, same memory
    del first
    gc.collect()
    assert finder.seen("b", pool[:1000]) is None  # same address, but "a" is gone
    moved = torch.zeros(8)
    assert finder.seen("m", moved) is None
    view = moved.view(8)
    moved.set_(torch.zeros(8).untyped_storage())  # "m" now reads other memory
    assert finder.seen("m.view", view) is None


def test_iterable_publish_of_temporaries_is_exact(server):
    """Fresh same-shaped tensors, each dropped after it is copied (the allocator reuses their
    addresses, 9 distinct of 12 when measured): nothing is aliased, every value arrives."""
    def provider():
        for i in range(12):
            yield f"t{i}", torch.full((4096,), float(i))

    manifest = server.publish(provider(), version=1)
    assert not any(spec.alias_of for spec in manifest.tensors)
    tensors = _fetch(server)
    for i in range(12):
        assert torch.equal(tensors[f"t{i}"], torch.full((4096,), float(i))), i


def _tied_manifest() -> pb.Manifest:
    embed = wire.spec_of("embed", torch.zeros(4, 3), 0)
    bias = wire.spec_of("bias", torch.zeros(3), embed.nbytes)
    return pb.Manifest(version=1, tensors=[embed, bias, wire.alias_spec("head", embed)],
                       total_bytes=embed.nbytes + bias.nbytes, checksum_algo="xxh3_64")


def test_a_client_without_alias_support_refuses_instead_of_missing_a_name():
    manifest = _tied_manifest()
    layout = wire.check_manifest(manifest)
    assert [(t.name, t.nbytes, t.alias_of) for t in layout] == [
        ("embed", 48, ""), ("bias", 12, ""), ("head", 0, "embed")]
    # What a client built before `alias_of` parses: the unknown field is dropped, and its own
    # size check (nbytes 0 for a float32[4, 3]) rejects the manifest.
    old_view = pb.Manifest()
    old_view.CopyFrom(manifest)
    for spec in old_view.tensors:
        spec.ClearField("alias_of")
    with pytest.raises(WeightSyncError, match="0 bytes for float32"):
        wire.check_manifest(old_view)


@pytest.mark.parametrize("change, message", [
    (lambda s: setattr(s, "alias_of", "nowhere"), "not an earlier sent tensor"),
    (lambda s: setattr(s, "alias_of", "head"), "not an earlier sent tensor"),
    (lambda s: s.shape.__setitem__(0, 5), "its tensor"),
    (lambda s: setattr(s, "dtype", "float16"), "its tensor"),
    (lambda s: setattr(s, "nbytes", 48), "nbytes 0"),
    (lambda s: setattr(s, "offset", 48), "nbytes 0"),
])
def test_bad_aliases_are_rejected(change, message):
    manifest = _tied_manifest()
    change(manifest.tensors[2])
    with pytest.raises(WeightSyncError, match=message):
        wire.check_manifest(manifest)


def test_an_alias_of_an_alias_or_a_later_tensor_is_rejected():
    chain = _tied_manifest()
    chain.tensors.append(wire.alias_spec("head.again", chain.tensors[2]))  # alias_of "head"
    with pytest.raises(WeightSyncError, match="not an earlier sent tensor"):
        wire.check_manifest(chain)
    later = _tied_manifest()
    later.tensors[0].alias_of = "bias"
    with pytest.raises(WeightSyncError, match="not an earlier sent tensor"):
        wire.check_manifest(later)


def test_fetch_result_must_hold_every_listed_name():
    manifest = _tied_manifest()
    complete = {"embed": torch.zeros(4, 3), "bias": torch.zeros(3)}
    complete["head"] = complete["embed"]
    _check_complete(manifest, complete)
    del complete["head"]
    with pytest.raises(WeightSyncError, match=r"missing \['head'\]"):
        _check_complete(manifest, complete)
