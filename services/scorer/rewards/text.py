"""Text helpers every reward shares: answer extraction and Search-R1's answer normalisation
(services/common/formats.py, shared with the learner's SFT skill measurement).

Rewards receive the decoded *response* (verl's naive manager passes only the response), but
callers that pass prompt + response (TinyZero, Search-R1's own trainer) must not be credited
for the prompt's tags (`<answer> and </answer>`, the example `<answer> Beijing </answer>`), so
`response_part` cuts at the last assistant marker and drops Search-R1's instruction.
"""

from __future__ import annotations

from services.common.formats import SEARCH_R1_TEMPLATE
from services.common.formats import gold_answers as gold_answers  # shared with the rollout
from services.common.formats import normalize_answer as normalize_answer  # the rewards' EM rule

ASSISTANT_MARKERS: tuple[str, ...] = ("<|im_start|>assistant", "Assistant:")
# Search-R1's instruction names every tag (`<answer> and </answer>`) and shows an example
# answer; none of it is the model's. The whole instruction is dropped (a prompt + response
# without an assistant marker), and the example sentence alone (another wrapper around it).
SEARCH_R1_INSTRUCTION = SEARCH_R1_TEMPLATE.split("{question}")[0]
TEMPLATE_EXAMPLE = "For example, <answer> Beijing </answer>."

def response_part(text: str) -> str:
    """The text after the last assistant marker (all of it when there is none), minus
    Search-R1's instruction and its example answer."""
    cut = -1
    for marker in ASSISTANT_MARKERS:
        position = text.rfind(marker)
        if position != -1:
            cut = max(cut, position + len(marker))
    if cut != -1:
        text = text[cut:]
    return text.replace(SEARCH_R1_INSTRUCTION, "").replace(TEMPLATE_EXAMPLE, "")


def tag_contents(text: str, tag: str) -> list[str]:
    """The content of every `<tag>…</tag>` block, left to right: what
    `re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)` returns, in linear time.

    Why not that pattern: from every opening tag without a closing one, its lazy `.*?` scans to
    the end of the text before giving up, and the regex engine then retries at the next opening
    tag, so 64 KB of `<answer>` took seconds and 1 MB would take minutes (issue 14). Here each
    block ends at the first closing tag after its opening tag, as the lazy match does, and an
    opening tag without a closing tag after it ends the scan: no later one can have one either.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    contents: list[str] = []
    position = 0
    while (start := text.find(opening, position)) != -1:
        end = text.find(closing, start + len(opening))
        if end == -1:
            break
        contents.append(text[start + len(opening):end])
        position = end + len(closing)
    return contents


def last_answer(text: str) -> str | None:
    """Content of the last `<answer>…</answer>` of the response, stripped; None when absent."""
    matches = tag_contents(response_part(text), "answer")
    if not matches:
        return None
    return matches[-1].strip()
