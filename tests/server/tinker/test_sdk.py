"""The tinker SDK, unmodified, trains and samples on our server (see conftest)."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch

from arctic_platform.engine.builtin import BUILTIN_MODELS
from arctic_platform.server.tinker.model_samplers import MAX_MODEL_SAMPLING_JOBS
from tests.server.tinker.conftest import (
    ALICE,
    BOB,
    TINY,
    check_snapshots_keep_their_weights,
    encode,
    reference_logprobs,
    sft_datum,
    tinker,
)

types = tinker.types
pytestmark = pytest.mark.slow


def logprobs_of(result, i: int) -> list[float]:
    return result.loss_fn_outputs[i]["logprobs"].tolist()


@pytest.fixture(scope="module")
def trainer(service_client):
    """A training client for the RL tests (their steps change its weights)."""
    return service_client.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()


def test_supervised_step_matches_the_base_model_and_lowers_the_loss(service_client):
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    info = client.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_data.model_name == TINY
    assert client.get_tokenizer().encode("7+8=15", add_special_tokens=False) == encode("7+8=15")
    data = [sft_datum("12+34=46", 6), sft_datum("7+8=15", 4)]
    result = client.forward_backward([d for _, d in data], "cross_entropy").result()
    want_sum = 0.0
    for i, (ids, datum) in enumerate(data):
        want = reference_logprobs(ids[:-1], ids[1:])
        np.testing.assert_allclose(logprobs_of(result, i), want, rtol=1e-4, atol=1e-5)
        weights = datum.loss_fn_inputs["weights"].tolist()
        want_sum += -sum(lp * w for lp, w in zip(want, weights, strict=True))
    assert result.metrics["loss:sum"] == pytest.approx(want_sum, rel=1e-4)
    step = client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert step.metrics["grad_norm:mean"] > 0
    for _ in range(3):
        client.forward_backward([d for _, d in data], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-2))
    after = client.forward([d for _, d in data], "cross_entropy").result()
    assert after.metrics["loss:sum"] < 0.9 * want_sum


def grpo_group(trainer, prompt_text: str, n: int = 4):
    """A cookbook-style group: samples of one prompt with the sampler's log-probs."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = encode(prompt_text)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    response = sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
    assert len(response.sequences) == n
    return prompt, response.sequences


def rl_datum(prompt, seq, advantage):
    sampled, sampled_lp = list(seq.tokens), list(seq.logprobs)
    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + sampled,
            "logprobs": [0.0] * pad + sampled_lp,
            "advantages": [0.0] * pad + [advantage] * len(sampled),
        },
    )


def tinker_loss(kind, lp, old, adv, config):
    """Tinker's documented per-token formulas, summed."""
    total = 0.0
    for p, q, a in zip(lp, old, adv, strict=True):
        r = math.exp(p - q)
        if kind == "importance_sampling":
            total += -r * a
        elif kind == "ppo":
            clipped = min(max(r, config["clip_low_threshold"]), config["clip_high_threshold"])
            total += -min(r * a, clipped * a)
        elif kind == "cispo":
            clipped = min(max(r, config["clip_low_threshold"]), config["clip_high_threshold"])
            total += -clipped * p * a
        else:
            total += -(p * a - 0.5 * config["beta"] * (p - q) ** 2)
    return total


LOSS_CONFIGS = {
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
    "dro": {"beta": 0.1},
}


@pytest.mark.parametrize("kind", list(LOSS_CONFIGS))
def test_grpo_step_with_each_policy_loss(trainer, kind):
    config = LOSS_CONFIGS[kind]
    prompt, sequences = grpo_group(trainer, "3+4=")
    rewards = [1.0, 0.0, 0.0, 1.0]
    mean = sum(rewards) / len(rewards)
    data = [rl_datum(prompt, s, r - mean) for s, r in zip(sequences, rewards, strict=True)]
    result = trainer.forward_backward(data, kind, config).result()
    total = 0.0
    for i, datum in enumerate(data):
        lp = logprobs_of(result, i)
        old = datum.loss_fn_inputs["logprobs"].tolist()
        # the sampler (merged weights) and the trainer (LoRA) score sampled tokens alike
        n = len(sequences[i].tokens)
        np.testing.assert_allclose(lp[-n:], old[-n:], rtol=1e-3, atol=1e-4)
        total += tinker_loss(kind, lp, old, datum.loss_fn_inputs["advantages"].tolist(), config)
    assert result.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = trainer.forward(data, "importance_sampling").result()
    gained = [  # the step favours the rewarded samples over the others
        sum(logprobs_of(after, i)) - sum(logprobs_of(result, i)) for i in range(len(data))
    ]
    assert gained[0] + gained[3] > gained[1] + gained[2]


def test_sampling_with_logprobs_prompt_logprobs_and_stop(service_client):
    sampler = service_client.create_sampling_client(base_model=TINY).result()
    assert sampler.get_base_model() == TINY
    prompt = encode("12+30=")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    response = sampler.sample(
        types.ModelInput.from_ints(prompt), 3, params, include_prompt_logprobs=True
    ).result()
    assert len(response.sequences) == 3
    assert len({s.sequence_id for s in response.sequences}) == 3
    for seq in response.sequences:
        # log p(token | prompt + earlier tokens) at each sampled position
        want = reference_logprobs(prompt + seq.tokens[:-1], prompt[1:] + seq.tokens)
        np.testing.assert_allclose(seq.logprobs, want[-len(seq.tokens) :], rtol=1e-4, atol=1e-4)
    assert response.prompt_logprobs[0] is None
    np.testing.assert_allclose(
        response.prompt_logprobs[1:], reference_logprobs(prompt[:-1], prompt[1:]), rtol=1e-4
    )
    first = response.sequences[0].tokens[0]
    stopped = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[first]),
    ).result()
    assert stopped.sequences[0].tokens == [first]
    assert stopped.sequences[0].stop_reason == "stop"
    assert stopped.prompt_cache_hit_tokens == len(prompt)  # the first sample cached it
    assert response.sequences[0].stop_reason in ("stop", "length")
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], response.prompt_logprobs[1:], rtol=1e-6)


def test_save_load_and_sample_from_saved_weights(service_client, server_url):
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    ids, datum = sft_datum("40+2=42", 5)
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state = client.save_state("step1").result()
    assert state.path == f"tinker://{client.model_id}/weights/step1"
    sampler_path = client.save_weights_for_sampler("step1").result().path
    assert sampler_path == f"tinker://{client.model_id}/sampler_weights/step1"

    resumed = service_client.create_training_client_from_state_with_optimizer(state.path).result()
    assert resumed.model_id != client.model_id
    for trained in (client, resumed):  # the same next step from the same state
        trained.forward_backward([datum], "cross_entropy")
        trained.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    mine = client.forward([datum], "cross_entropy").result()
    theirs = resumed.forward([datum], "cross_entropy").result()
    np.testing.assert_allclose(logprobs_of(theirs, 0), logprobs_of(mine, 0), rtol=1e-5)

    prompt = types.ModelInput.from_ints(ids[:5])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    saved = service_client.create_sampling_client(model_path=sampler_path).result()
    live = client.create_sampling_client(sampler_path).result()
    assert saved.sample(prompt, 1, greedy).result().sequences[0].tokens == (
        live.sample(prompt, 1, greedy).result().sequences[0].tokens
    )

    rest = tinker.RestClient(base_url=server_url, api_key=ALICE)
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert {(c.checkpoint_type, c.tinker_path) for c in listed} == {
        ("training", state.path),
        ("sampler", sampler_path),
    }
    run = rest.get_training_run(client.model_id).result()
    assert run.base_model == TINY and run.lora_rank == 4
    other = tinker.RestClient(base_url=server_url, api_key=BOB)
    with pytest.raises(tinker.NotFoundError):
        other.list_checkpoints(client.model_id).result()


def test_training_runs_are_listed_a_page_at_a_time(service_client, server_url):
    """The SDK pages with ``limit`` and ``offset`` until a page comes back short; the server
    answered every run on every page (a pager never ended)."""
    made = {
        service_client.create_lora_training_client(base_model=TINY, rank=4).result().model_id
        for _ in range(2)
    }
    rest = tinker.RestClient(base_url=server_url, api_key=ALICE)
    whole = rest.list_training_runs(limit=1000).result()
    ids = [r.training_run_id for r in whole.training_runs]
    assert made <= set(ids) and whole.cursor.total_count == len(ids) >= 2
    pages = [rest.list_training_runs(limit=1, offset=i).result() for i in range(len(ids) + 1)]
    assert [[r.training_run_id for r in p.training_runs] for p in pages] == [[i] for i in ids] + [
        []
    ]
    assert all(p.cursor.total_count == len(ids) for p in pages)
    bob = tinker.RestClient(base_url=server_url, api_key=BOB).list_training_runs().result()
    assert not made & {r.training_run_id for r in bob.training_runs}
    for query, field in (("limit=0", "limit"), ("offset=-1", "offset"), ("limit=x", "limit")):
        bad = httpx.get(f"{server_url}/api/v1/training_runs?{query}", headers={"X-API-Key": ALICE})
        assert bad.status_code == 400 and field in bad.text, bad.text


def test_a_sampling_client_keeps_its_snapshot_after_the_trainer_moves_on(service_client):
    check_snapshots_keep_their_weights(service_client)


def test_checkpoint_samplers_beyond_the_limit_release_their_jobs_and_reload_on_use(
    service_client, server_app
):
    """The cookbook creates a sampling client on every periodic checkpoint; the SDK never says
    when one is dropped. Past the limit the least recently used job is cancelled (its engine
    freed), and a client on it samples again by reloading its checkpoint."""
    ops, service = server_app.state.tinker, server_app.state.service
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=8).result()
    prompt = types.ModelInput.from_ints(encode("5+6="))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    _, datum = sft_datum("5+6=11", 4)

    def draw(sampler):
        seq = sampler.sample(prompt, 1, params).result().sequences[0]
        return list(seq.tokens), list(seq.logprobs)

    samplers, draws, models = [], [], []
    for i in range(MAX_MODEL_SAMPLING_JOBS + 1):
        client.forward_backward([datum], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-2))
        path = client.save_weights_for_sampler(f"periodic{i}").result().path
        samplers.append(service_client.create_sampling_client(model_path=path).result())
        draws.append(draw(samplers[-1]))
        owner = server_app.state.auth.owner(f"Bearer {ALICE}")  # the tenant ALICE's key is
        record = ops.state.sampler(samplers[-1]._sampling_session_id, owner)
        assert record.model_path == path
        models.append(record.model)
        if i == 0:
            oldest_job = ops.model_jobs.jobs(owner)[models[0]]
    kept = ops.model_jobs.jobs(owner)
    assert list(kept) == models[1:]  # the newest ones, least recently used first
    assert service.get_job(oldest_job, owner=owner)["status"] == "cancelled"
    # a sample in flight keeps its job: reloading the oldest releases the next idle one instead
    session = ops.state.session(record.session_id, owner)
    busy = ops.model_jobs.begin(session, owner, models[1])
    assert draw(samplers[0]) == draws[0]  # reloaded: its own checkpoint's weights again
    ops.model_jobs.end(owner, models[1], busy)
    assert list(ops.model_jobs.jobs(owner)) == [models[1], models[0]]
    assert service.get_job(kept[models[2]], owner=owner)["status"] == "cancelled"
    assert draw(samplers[2]) == draws[2]


def test_futures_resolve_out_of_order_and_keep_the_client_order(service_client):
    data = [sft_datum("9+9=18", 4)[1]]
    queued = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
    stepwise = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
    futures = []
    for lr in (3e-2, 1e-2):
        futures.append(queued.forward_backward(data, "cross_entropy"))
        futures.append(queued.optim_step(types.AdamParams(learning_rate=lr)))
    last = queued.forward(data, "cross_entropy")
    final = last.result()  # retrieved first, yet it ran after every earlier op
    for future in reversed(futures):
        future.result()
    for lr in (3e-2, 1e-2):
        stepwise.forward_backward(data, "cross_entropy").result()
        stepwise.optim_step(types.AdamParams(learning_rate=lr)).result()
    want = stepwise.forward(data, "cross_entropy").result()
    assert logprobs_of(final, 0) == logprobs_of(want, 0)


def test_bad_requests_name_the_field_and_leave_the_model_alone(service_client):
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    _, datum = sft_datum("5+5=10", 4)
    before = client.forward([datum], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn: unknown loss 'sft'"):
        client.forward_backward([datum], "sft").result()
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_config\.eps: not a ppo setting"):
        client.forward_backward([datum], "ppo", {"eps": 0.2}).result()
    short = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": [1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.weights"):
        client.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_inputs\.logprobs: missing"):
        client.forward_backward([datum], "importance_sampling").result()
    # the refused requests used up their seq_ids; the client goes on, weights untouched
    client.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    after = client.forward([datum], "cross_entropy").result()
    assert logprobs_of(after, 0) == logprobs_of(before, 0)


def test_a_datum_longer_than_the_context_is_refused_and_changes_nothing(service_client):
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    _, datum = sft_datum("5+5=10", 4)
    before = client.forward([datum], "cross_entropy").result()
    context = BUILTIN_MODELS["tiny"].max_position_embeddings
    tokens = encode("1") * context  # with its last target the model would run over context + 1
    long = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": tokens, "weights": [1.0] * context},
    )
    refused = rf"data\[0\]\.model_input: .* is {context + 1} tokens, more than the model's context"
    for call in (client.forward_backward, client.forward):
        with pytest.raises(tinker.BadRequestError, match=refused):
            call([long, datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    after = client.forward([datum], "cross_entropy").result()
    assert logprobs_of(after, 0) == logprobs_of(before, 0)


def test_wrong_api_key_is_refused(server_url):
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server_url, api_key="tml-mallory").create_sampling_client(
            base_model=TINY
        ).result()


def test_download_ttl_and_delete(service_client, server_url, tmp_path):
    import urllib.request

    from transformers import AutoModelForCausalLM

    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=4).result()
    _, datum = sft_datum("1+1=2", 3)
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = client.save_weights_external("export").result().path
    assert path == f"tinker://{client.model_id}/external_weights/export"
    rest = tinker.RestClient(base_url=server_url, api_key=ALICE)
    links = rest.get_external_weights_urls(path).result()
    assert "config.json" in links.urls
    state = client.save_state("state").result().path  # not downloadable: a 400 naming it
    refused = httpx.get(
        f"{server_url}/api/v1/training_runs/{client.model_id}/checkpoints/weights/state"
        "/external_weights_urls",
        headers={"X-API-Key": ALICE},
    )
    assert refused.status_code == 400 and refused.json()["field"] == "checkpoint", refused.text
    assert state.endswith("/weights/state")
    for name, url in links.urls.items():  # plain GETs, no credentials, as the SDK's CLI does
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url) as response:
            target.write_bytes(response.read())
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # merged weights, plain HF
    trained = client.forward([datum], "cross_entropy").result()
    with torch.no_grad():
        ids = datum.model_input.to_ints()
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    want = logits.log_softmax(-1)[range(len(ids)), targets].tolist()
    np.testing.assert_allclose(logprobs_of(trained, 0), want, rtol=1e-4, atol=1e-4)

    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert listed[path].expires_at is not None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 5).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    remaining = rest.list_checkpoints(client.model_id).result().checkpoints
    assert path not in {c.tinker_path for c in remaining}


def test_a_released_model_job_is_cancelled_outside_the_registry_lock(server_app, monkeypatch):
    """Cancelling closes an engine (seconds for a vLLM process or Ray actors): done under the
    registry's lock it would hold up every other sampler's requests meanwhile."""
    from arctic_platform.server.tinker.model_samplers import ModelSamplingJobs
    from arctic_platform.server.tinker.state import Session

    service = server_app.state.service
    registry = ModelSamplingJobs(service, limit=1)
    session = Session("lock-test", owner=None)
    cancel = service.cancel_job
    lock_free_during_cancel = []

    def cancel_checking_the_lock(job_id, **kwargs):
        free = registry._lock.acquire(blocking=False)
        if free:
            registry._lock.release()
        lock_free_during_cancel.append(free)
        return cancel(job_id, **kwargs)

    monkeypatch.setattr(service, "cancel_job", cancel_checking_the_lock)
    first = registry.sub_job(session, None, TINY)
    second = registry.begin(session, None, "builtin:small")
    assert lock_free_during_cancel == [True]  # the first job was released, lock not held
    assert service.get_job(first.split(":")[0])["status"] == "cancelled"
    registry.end(None, "builtin:small", second)
    for job_id in session.job_ids[1:]:
        service.cancel_job(job_id)


def test_tinker_ops_count_their_tokens_as_the_onprem_ops_do(service_client, server_app):
    registry = server_app.state.service.metrics.registry

    def tokens(op: str) -> float:
        return registry.get_sample_value("arctic_tokens_processed_total", {"op": op}) or 0.0

    trained_before, sampled_before = tokens("forward-backward"), tokens("generate")
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    data = [sft_datum("12+34=46", 6), sft_datum("7+8=15", 4)]
    client.forward_backward([d for _, d in data], "cross_entropy").result()
    # The batch's rows x width, as an on-prem forward-backward counts it (a row per datum of
    # its model_input and its last target).
    width = max(len(ids) for ids, _ in data)
    assert tokens("forward-backward") - trained_before == len(data) * width
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    response = sampler.sample(types.ModelInput.from_ints(encode("1+2=")), 3, params).result()
    sampled = sum(len(s.tokens) for s in response.sequences)
    assert sampled > 0 and tokens("generate") - sampled_before == sampled


def test_train_unembed_on_a_tied_model_is_listed_as_ignored(service_client, server_app):
    """Tinker's LoRA adapts the unembedding by default (``train_unembed``); ``builtin:tiny`` ties
    it to the embedding, so its job trains without it and says so in its ``ignored_settings``
    (the jobs API shows the tenant), while ``train_unembed=False`` asks for nothing ignored."""
    service = server_app.state.service

    def ignored_of_new_job(**lora) -> dict:
        before = {job.info()["job_id"] for job in service.jobs.all()}
        service_client.create_lora_training_client(base_model=TINY, rank=4, **lora).result()
        (new,) = [j.info() for j in service.jobs.all() if j.info()["job_id"] not in before]
        (trainer,) = [s for s in new["sub_jobs"] if s["job_type"] == "training"]
        return trainer["ignored_settings"]

    assert "tie_word_embeddings" in ignored_of_new_job()["lora.train_unembed"]
    assert "lora.train_unembed" not in ignored_of_new_job(train_unembed=False)
