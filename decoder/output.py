"""Output processing: a step's picked tokens become each request's `Delta`s.

Per picked token: it joins its sequence (EOS or max_tokens finish it), the no-repeat-n-gram rule
sees it, the text grows by its incremental decoding (special tokens dropped when asked), a stop
string may end the sequence there, and so may the loop detector (decoder/repetition.py:
`finish_reason` "repetition", the text cut where the loop began). A delta holds back a tail of
text that could still grow into a stop string.
"""
from __future__ import annotations

from collections.abc import Callable

from .sequence import Delta, Sequence
from .tokenizer import find_stop, holdback


class OutputProcessor:
    def __init__(self, eos_id: int, special_ids: frozenset[int]):
        self.eos_id, self.special_ids = eos_id, special_ids

    def append_tokens(self, seqs: list[Sequence],
                      tokens: list[int]) -> list[tuple[Sequence, int, str | None]]:
        """Each sequence's picked token appended (the next decode step feeds it); EOS or
        max_tokens finishes the sequence (`done`: its row is for the caller to free).
        -> (sequence, token, "eos" / "length" / None) for each."""
        picked = []
        for seq, token in zip(seqs, tokens):
            seq.tokens.append(token)
            seq.pending = token
            reason = None
            if token == self.eos_id and not seq.request.params.ignore_eos:
                reason = "eos"
            elif len(seq.tokens) >= seq.max_tokens:
                reason = "length"
            if reason is not None:
                seq.done = True
            picked.append((seq, token, reason))
        return picked

    def report(self, picked: list[tuple[Sequence, int, str | None]],
               retire: Callable[[Sequence], None]) -> list[Delta]:
        """Per picked token: the n-gram state, the text, stop strings; one delta each. A stop
        string ends its sequence here (`retire`; its row of the step in flight goes unused)."""
        deltas = []
        for seq, token, reason in picked:
            if seq.ngram is not None:
                seq.ngram.push(token)
            if reason != "eos" and not (seq.request.params.skip_special_tokens
                                        and token in self.special_ids):
                seq.text += seq.detok.push([token])
            stops = seq.request.params.stop
            cut = find_stop(seq.text, list(stops), seq.emitted) if stops else None
            repetition = None
            if cut is not None:
                seq.text, reason = seq.text[:cut], "stop"
            elif seq.loop is not None:
                seq.text_ends.append(len(seq.text))
                loop = seq.loop.push(token) if reason is None else None
                if loop is not None:  # the text before the loop: what a whole answer keeps
                    kept = seq.text_ends[loop.start_token - 1] if loop.start_token else 0
                    repetition = {"start_token": loop.start_token, "period": loop.period, "text_chars": kept}
                    seq.text, reason = seq.text[:max(kept, seq.emitted)], "repetition"
            if reason in ("stop", "repetition") and not seq.done:
                retire(seq)
            if reason is not None and reason not in ("stop", "repetition"):
                seq.text += seq.detok.flush()
            deltas.append(self.delta(seq, [token], reason, repetition))
        return deltas

    def delta(self, seq: Sequence, tokens: list[int], reason: str | None, repetition: dict | None = None) -> Delta:
        # Hold back a tail that could still grow into a stop string.
        end = len(seq.text) if reason else len(seq.text) - holdback(seq.text, list(seq.request.params.stop))
        end = max(end, seq.emitted)
        text, seq.emitted = seq.text[seq.emitted:end], end
        return Delta(seq.request.request_id, text, tokens, reason is not None, reason,
                     len(seq.request.prompt_ids), len(seq.tokens), repetition=repetition)
