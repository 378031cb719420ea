"""Character-level words and numbers for a demo's tokenizer (same files, fewer merges).

The tiny BPE merges common letter pairs (``Ġhe``, ``llo``), so ``hello`` is two tokens and
reversing it needs the spelling of each — which a 2 M-parameter model trained for an hour
does not learn (``hello`` → ``ot``). Dropping every merge whose result is only letters
(either case) or only digits (after an optional leading space) spells words and numbers one
character per token. The vocabulary and its ids are unchanged (the merged tokens just never
occur), so the checkpoint's format and embedding size stay those of the tiny checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_SPELLED = re.compile(r"Ġ?([A-Za-z]+|[0-9]+)")


def keep_merge(left: str, right: str) -> bool:
    """False for a merge that would join letters of a word (either case: ``Hello`` and
    ``HELLO`` are reversed letter by letter too) or digits of a number."""
    return _SPELLED.fullmatch(left + right) is None


def spell_words_and_numbers(checkpoint: Path) -> int:
    """Drops those merges from ``checkpoint``'s tokenizer.json (LLaDA) or merges.txt
    (Qwen2 / I-DLM) in place; returns how many were dropped."""
    tok_json = checkpoint / "tokenizer.json"
    if tok_json.is_file():
        data = json.loads(tok_json.read_text())
        merges = data["model"]["merges"]
        kept = [m for m in merges if keep_merge(*(m if isinstance(m, list) else m.split(" ")))]
        data["model"]["merges"] = kept
        tok_json.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        return len(merges) - len(kept)
    merges_txt = checkpoint / "merges.txt"
    lines = merges_txt.read_text().splitlines()
    header = [ln for ln in lines if ln.startswith("#")]
    merges = [ln for ln in lines if ln and not ln.startswith("#")]
    kept = [ln for ln in merges if keep_merge(*ln.split(" "))]
    merges_txt.write_text("\n".join(header + kept) + "\n")
    return len(merges) - len(kept)
