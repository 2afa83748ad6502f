"""Turns per-step token outputs into text deltas: detokenization and stop strings.

Streamed deltas concatenate to exactly the final text. Stop strings are matched on
the text (so across token boundaries) and are not part of the output; while a request
has stop strings, the last `max_stop_len - 1` characters are held back, since they
might be the start of a stop string completed by the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.outputs import EngineCoreOutput, RequestOutput
from worker.model.sampler import TokenLogprobs
from worker.model.tokenizer import IncrementalDetokenizer, Tokenizer
from worker.request import FinishReason, Request


@dataclass
class _State:
    request: Request
    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    max_stop_len: int
    text: str = ""
    emitted: int = 0  # characters of text already sent
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        p = req.sampling_params
        self._states[req.request_id] = _State(
            request=req,
            detok=self.tokenizer.detokenizer(p.skip_special_tokens),
            stop=p.stop,
            max_stop_len=max((len(s) for s in p.stop), default=0),
        )

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def process(
        self, outputs: list[EngineCoreOutput], now: float
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the caller-facing outputs and the ids that a stop string has ended
        (the engine must free those in the scheduler)."""
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for out in outputs:
            st = self._states.get(out.request_id)
            if st is None:
                continue
            req = st.request
            finish, stop_reason = out.finish_reason, out.stop_reason
            start_len = len(st.text)
            st.token_ids.extend(out.new_token_ids)
            # A token that ended the request (EOS, stop token id) is kept in the token
            # ids but not rendered into the text.
            render = out.new_token_ids[:-1] if out.stopped_by_token else out.new_token_ids
            for tok in render:
                st.text += st.detok.step(tok)
            if st.stop and (finish is None or finish == FinishReason.LENGTH):
                hit = self._find_stop(st, start_len)
                if hit is not None:
                    pos, s = hit
                    st.text = st.text[:pos]
                    finish, stop_reason = FinishReason.STOP, s
                    if out.finish_reason is None:
                        stopped.append(out.request_id)
            done = finish is not None
            if done and not isinstance(stop_reason, str):
                # A character cut short by the end of generation is rendered as decode() would.
                st.text += st.detok.flush()
            end = (
                len(st.text)
                if done
                else max(st.emitted, len(st.text) - max(0, st.max_stop_len - 1))
            )
            delta = st.text[st.emitted : end]
            st.emitted = end
            logprobs: list[TokenLogprobs] | None = (
                [out.logprobs] if out.logprobs is not None else None
            )
            if not done:
                results.append(
                    RequestOutput(
                        request_id=out.request_id,
                        delta_text=delta,
                        delta_token_ids=list(out.new_token_ids),
                        finished=False,
                        logprobs=logprobs,
                    )
                )
                continue
            if req.timing.finished is None:
                req.timing.finished = now
            del self._states[out.request_id]
            results.append(
                RequestOutput(
                    request_id=out.request_id,
                    delta_text=delta,
                    delta_token_ids=list(out.new_token_ids),
                    finished=True,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    text=st.text,
                    token_ids=st.token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(0, req.num_cached_tokens),
                    logprobs=logprobs,
                    timing=req.timing.summary(),
                )
            )
        return results, stopped

    def _find_stop(self, st: _State, start_len: int) -> tuple[int, str] | None:
        if len(st.token_ids) < st.request.sampling_params.min_tokens:
            return None
        # Only text that could contain a newly completed stop string is searched.
        window_start = max(0, start_len - st.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in st.stop:
            pos = st.text.find(s, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best
