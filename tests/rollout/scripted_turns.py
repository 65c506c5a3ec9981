"""Watching a scripted policy's turns in the agent-loop tests."""

from __future__ import annotations


def record_generated_turns(engine) -> list[list[int]]:
    """Wrap `engine.step` so that each finished turn's generated token ids are appended to the
    list returned here, in the order the engine produced them."""
    seen: list[list[int]] = []
    step = engine.step

    def recorded():
        outputs = step()
        seen.extend(list(o.token_ids) for o in outputs if o.request.tag[0] == "turn")
        return outputs

    engine.step = recorded
    return seen
