"""A LoRA adapter served beside the base model (`--lora`): listed under /v1/models, and answering
chats and scored completions as the merged model does, unlike the base."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tests.serve.live.openai_server.client import ask, complete


def test_models_lists_the_served_model_and_its_adapter(server, lora):
    """Listed and retrieved one by one (`models.retrieve`), each with the context length the
    server checks prompt + max_tokens against; another name is a 404."""
    models = server.models.list()
    assert [m.id for m in models.data] == ["tiny-gemma4", "tiny-lora"]
    adapter = models.data[1].model_dump()
    assert adapter["parent"] == "tiny-gemma4" and adapter["root"] == str(lora[0])
    for listed in models.data:
        retrieved = server.models.retrieve(listed.id).model_dump()
        assert retrieved == {**listed.model_dump(), "created": retrieved["created"]}
        assert retrieved["max_model_len"] == 2048  # the app's --max-context-len
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        server.models.retrieve("tiny-gemma5")


def test_an_adapter_answers_as_the_merged_model_and_unlike_the_base(server, tiny_path, lora):
    """`model: tiny-lora` runs the adapter: its greedy reply is the merged model's (transformers
    generate on the same encoded prompt), and not the base model's; both asked at once."""
    from areno.processing import Processor

    question = "Tell me a story about a fox."
    processor = Processor(tiny_path("gemma4"))
    inputs = processor.encode([{"role": "user", "content": question}], [])
    out = lora[1].generate(**inputs.model_inputs(), max_new_tokens=8, do_sample=False)
    merged = processor.tokenizer.decode(
        out[0, inputs.num_prompt_tokens :], skip_special_tokens=True
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        adapted, base = pool.map(
            lambda model: ask(server, question, model=model, max_tokens=8),
            ["tiny-lora", "tiny-gemma4"],
        )
    assert adapted.model == "tiny-lora" and base.model == "tiny-gemma4"
    assert adapted.choices[0].message.content == merged
    assert base.choices[0].message.content != adapted.choices[0].message.content


def test_echo_with_a_generated_token_and_an_adapter(server, tokenizer):
    """The other loglikelihood form (max_tokens 1): the prompt's logprobs, then the sampled
    token's; a LoRA adapter named in `model` scores and generates as that adapter."""
    ids = tokenizer("A small test")["input_ids"]
    base, adapted = (
        complete(server, [ids], echo=True, logprobs=1, max_tokens=1, model=model)
        for model in ("tiny-gemma4", "tiny-lora")
    )
    for response in (base, adapted):
        logprobs = response.choices[0].logprobs
        assert len(logprobs.token_logprobs) == len(ids) + 1
        assert response.choices[0].text.startswith(tokenizer.decode(ids))
        assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert adapted.model == "tiny-lora"
    assert adapted.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
