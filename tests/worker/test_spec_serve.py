"""Speculative decoding end to end: `sarathi serve --speculative ngram` as a real process tree
(HTTP gateway, scheduler, worker process over ZeroMQ) answers a copy-from-the-prompt chat,
streamed, with the text of the offline engine without speculation; the request body's
`"speculative": false` keeps a request's drafts at zero; /metrics reports drafts and acceptance;
a stop string cuts the text where it would without drafts."""
from __future__ import annotations

import openai
import pytest

from sarathi.llm import LLM
from shared.sampling import SamplingParams
from tests.support.e2e_stack import EmbeddedStack, get, metric
from tests.worker.test_spec_smollm2 import CONVERSATIONS

pytestmark = pytest.mark.slow


def drafts(stack) -> float:
    return metric(get(stack.metrics_urls[0])[1], "sarathi_scheduler_spec_draft_tokens_total")


def test_serve_with_ngram_drafts_answers_as_the_offline_engine(tmp_path):
    messages = CONVERSATIONS[0]
    want = LLM(num_blocks=128, threads=1).chat([messages], SamplingParams(temperature=0.0, max_tokens=40))[0].text
    stack = EmbeddedStack(tmp_path, speculative="ngram", num_speculative_tokens=6, threads=1)
    try:
        c = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        opted_out = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40,
                                              temperature=0, extra_body={"speculative": False})
        assert opted_out.choices[0].message.content == want
        assert drafts(stack) == 0
        stream = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40,
                                           temperature=0, stream=True)
        got = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert got == want
        text = get(stack.metrics_urls[0])[1]
        assert metric(text, "sarathi_scheduler_spec_draft_tokens_total") > 0
        assert metric(text, "sarathi_scheduler_spec_accepted_tokens_total") > 0
        assert 0 < metric(text, "sarathi_scheduler_spec_acceptance_ratio") <= 1
        # a stop string inside a burst of accepted tokens: the text ends before it, as without drafts
        stop = want.split()[len(want.split()) // 2]
        cut = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40,
                                        temperature=0, stop=[stop])
        assert cut.choices[0].message.content == want[:want.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    finally:
        stack.close()
