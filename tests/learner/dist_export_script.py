"""Run by test_multirank.py under torchrun (2 CPU ranks): the weight export at each ZeRO stage
given, one after the other.

Per stage, every rank first takes a reference of the weights the way the export used to (ZeRO-3:
the whole model gathered at once; otherwise the module's state dict), then runs
`state_dict_for_export` while counting host copies (`engine.host_copy` and `Tensor.clone` /
`Tensor.cpu` calls), and writes OUT/export_z{stage}_rank{rank}.json: the exported names, the
copies made, the number of gathers, and on rank 0 whether every tensor equals the reference and
whether the tied lm_head shares the embedding's copy."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

torch.set_num_threads(1)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@contextmanager
def counting_host_copies() -> Iterator[dict[str, int]]:
    """Count calls of the engine's host copy and of Tensor.clone / Tensor.cpu meanwhile."""
    from services.learner import engine as E

    counts = {"host_copy": 0, "clone": 0, "cpu": 0}

    def counted(name: str, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return wrapper

    # getattr: the same script ran against the engine before host_copy existed (a red test)
    saved = (getattr(E, "host_copy", None), torch.Tensor.clone, torch.Tensor.cpu)
    E.host_copy = counted("host_copy", saved[0])
    torch.Tensor.clone = counted("clone", saved[1])
    torch.Tensor.cpu = counted("cpu", saved[2])
    try:
        yield counts
    finally:
        E.host_copy, torch.Tensor.clone, torch.Tensor.cpu = saved


def reference_weights(engine) -> dict[str, torch.Tensor]:
    """The weights as the export produced them before: a whole-model gather under ZeRO-3."""
    import deepspeed

    module = engine.module
    if engine.zero_stage != 3:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def export_once(policy: str, zero_stage: int) -> dict:
    from services.common.config.learner import LearnerSection
    from services.learner import distributed as D
    from services.learner.trainer import PolicyTrainer

    trainer = PolicyTrainer(policy, LearnerSection(zero_stage=zero_stage, seed=0))
    engine = trainer.policy
    reference = reference_weights(engine)
    if engine.zero_stage == 3:  # about one decoder layer per gather: several collectives
        engine.export_group_bytes = sum(p.ds_numel * p.element_size()
                                        for p in engine.module.model.layers[0].parameters())
    with counting_host_copies() as copies:
        exported = trainer.state_dict_for_export()
    record = {"keys": list(exported), "copies": dict(copies), "groups": engine.export_groups,
              "reference_keys": list(reference)}
    if D.rank() == 0:
        record["equal"] = all(torch.equal(exported[k], v) for k, v in reference.items())
        record["tied_shared"] = exported[HEAD].data_ptr() == exported[EMBED].data_ptr()
    D.barrier()  # both ranks are past the export: no gather left waiting
    return record


def main() -> None:
    from services.learner import distributed as D

    policy, out, stages = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    for stage in stages:
        record = export_once(policy, stage)
        with open(f"{out}/export_z{stage}_rank{D.rank()}.json", "w") as fh:
            json.dump(record, fh)


if __name__ == "__main__":
    main()
