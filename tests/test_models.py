"""The four roles on real (tiny, locally built) Hugging Face checkpoints."""

import copy
import dataclasses
import hashlib
import warnings

import pytest
import torch
from helpers import assert_close

from posttrain.models import (
    ModelConfig,
    Reference,
    load_causal_lm,
    load_critic,
    load_policy,
    load_reward_model,
    load_scalar_model,
    load_tokenizer,
    response_logprobs,
    sequence_logprobs,
    sequence_scores,
    token_values,
)
from posttrain.models.tiny import build_tiny


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_is_deterministic_and_loads_like_a_hub_model(tmp_path, tiny_dir):
    build_tiny(tmp_path / "again", seed=0)
    assert _sha(tmp_path / "again" / "model.safetensors") == _sha(tiny_dir / "policy" / "model.safetensors")
    build_tiny(tmp_path / "other", seed=5)
    assert _sha(tmp_path / "other" / "model.safetensors") != _sha(tiny_dir / "policy" / "model.safetensors")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy")  # plain transformers, no posttrain
    tok = AutoTokenizer.from_pretrained(tiny_dir / "policy")
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.decode(tok("12+34=46").input_ids, skip_special_tokens=True) == "12+34=46"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert text == "<bos>user: hi\nassistant: yo<eos>"
    assert tok(text, add_special_tokens=False).input_ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("kind", ["policy", "value"])
def test_dropout_off_two_forwards_bit_identical_in_train_mode(tiny_dir, kind):
    config = ModelConfig(path=str(tiny_dir / "policy"))
    model = load_causal_lm(config) if kind == "policy" else load_scalar_model(config, "value")
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model.train()
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    out1, out2 = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.equal(out1, out2)


def _layouts(prompt, response, other_prompt, other_response, pad_id):
    """The same (prompt, response) alone, in the rollout layout, fully left-padded and fully right-padded."""
    seq, other = prompt + response, other_prompt + other_response
    L = max(len(seq), len(other)) + 2
    P = max(len(prompt), len(other_prompt)) + 1
    T = max(len(response), len(other_response)) + 1

    def rows(spec):
        ids = torch.full((2, spec[0]), pad_id)
        mask = torch.zeros((2, spec[0]), dtype=torch.long)
        return ids, mask

    layouts = {"alone": (torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), 0, len(prompt))}
    ids, mask = rows((P + T,))  # rollout layout: prompt left-padded to P, response right-padded to T
    for i, (p, r) in enumerate(((prompt, response), (other_prompt, other_response))):
        ids[i, P - len(p) : P], mask[i, P - len(p) : P] = torch.tensor(p), 1
        ids[i, P : P + len(r)], mask[i, P : P + len(r)] = torch.tensor(r), 1
    layouts["rollout"] = (ids, mask, 0, P)
    ids, mask = rows((L,))
    ids[0, L - len(seq) :], mask[0, L - len(seq) :] = torch.tensor(seq), 1
    ids[1, L - len(other) :], mask[1, L - len(other) :] = torch.tensor(other), 1
    layouts["left"] = (ids, mask, 0, L - len(seq) + len(prompt))
    ids, mask = rows((L,))
    ids[0, : len(seq)], mask[0, : len(seq)] = torch.tensor(seq), 1
    ids[1, : len(other)], mask[1, : len(other)] = torch.tensor(other), 1
    layouts["right"] = (ids, mask, 0, len(prompt))
    return layouts


def test_padding_invariance_of_logprobs_and_reward_scores(tiny_dir, tokenizer):
    policy = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy")))
    reward = load_reward_model(ModelConfig(path=str(tiny_dir / "reward")))
    prompt, response = tokenizer("12+34=").input_ids, tokenizer("46;", add_special_tokens=False).input_ids + [2]
    other_p, other_r = tokenizer("a much longer prompt here").input_ids, [40, 41]
    results = {}
    for name, (ids, mask, row, start) in _layouts(prompt, response, other_p, other_r, tokenizer.pad_token_id).items():
        with torch.no_grad():
            lp = sequence_logprobs(policy, ids, mask)[row, start : start + len(response)]
            score = sequence_scores(reward, ids, mask)[row]
        results[name] = (lp, score)
    for name in ("rollout", "left", "right"):
        assert_close(results[name][0], results["alone"][0], rtol=0, atol=1e-5)
        assert_close(results[name][1], results["alone"][1], rtol=0, atol=1e-5)
    # response_logprobs on the rollout layout reads the same numbers
    ids, mask, _, P = _layouts(prompt, response, other_p, other_r, tokenizer.pad_token_id)["rollout"]
    with torch.no_grad():
        lp, entropy = response_logprobs(policy, ids, mask, ids.shape[1] - P, with_entropy=True)
    assert_close(lp[0, : len(response)], results["alone"][0], rtol=0, atol=1e-5)
    assert (entropy[0, : len(response)] > 0).all()


def _reward_alone(reward, seq):
    with torch.no_grad():
        hidden = reward.base_model(input_ids=torch.tensor([seq])).last_hidden_state
        return reward.score(hidden[0, -1]).item()


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_reward_read_at_last_response_token(tiny_dir, pad_side):
    """pad == eos, EOS inside the prompt, several EOS ids, no EOS: the score comes from the last
    response token (docs/pitfalls.md #8)."""
    reward = load_reward_model(ModelConfig(path=str(tiny_dir / "reward")))
    eos = 2
    pad = eos  # pad == eos: an id-based index would stop at the first EOS-looking pad
    cases = [
        [1, 20, 21, eos, 22, 23, 30, 31, eos],  # EOS inside the prompt, response ends in EOS
        [1, 20, 21, 30, 31, 32],  # no EOS at all (a truncated response)
        [1, 20, 30, 31, 7],  # ends in another EOS id (7 stands for a second end-of-turn token)
    ]
    L = max(map(len, cases)) + 3
    ids = torch.full((len(cases), L), pad)
    mask = torch.zeros((len(cases), L), dtype=torch.long)
    for i, seq in enumerate(cases):
        span = slice(L - len(seq), L) if pad_side == "left" else slice(0, len(seq))
        ids[i, span], mask[i, span] = torch.tensor(seq), 1
    with torch.no_grad():
        scores = sequence_scores(reward, ids, mask)
    expected = torch.tensor([_reward_alone(reward, seq) for seq in cases])
    assert_close(scores, expected, rtol=0, atol=1e-5)


def _train_steps(model, steps=3, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    ids = torch.tensor([[1, 20, 21, 22, 23, 24, 25]])
    for _ in range(steps):
        loss = -sequence_logprobs(model, ids, torch.ones_like(ids)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


@pytest.mark.parametrize("kind", ["copy", "lora"])
def test_reference_is_isolated_from_policy_updates(tiny_dir, kind):
    config = ModelConfig(path=str(tiny_dir / "policy"), lora=LORA if kind == "lora" else None)
    policy = load_policy(config)
    reference = Reference.from_policy(policy)
    assert reference.shares_policy_weights == (kind == "lora")
    ids = torch.tensor([[1, 30, 31, 32, 40, 41, 42]])
    mask = torch.ones_like(ids)
    before = reference.logprobs(ids, mask, 3)
    with torch.no_grad():
        policy_before = response_logprobs(policy, ids, mask, 3)[0]
    _train_steps(policy)
    after = reference.logprobs(ids, mask, 3)
    with torch.no_grad():
        policy_after = response_logprobs(policy, ids, mask, 3)[0]
    assert torch.equal(before, after)
    assert (policy_after - policy_before).abs().max() > 1e-4  # the policy did move
    if kind == "lora":
        assert all(p.requires_grad == ("lora_" in n) for n, p in policy.named_parameters())


def test_policy_from_trained_adapter_keeps_adapter_as_reference(tiny_dir, tmp_path):
    """KL is 0 at step 0 when training starts from an adapter (docs/pitfalls.md #11)."""
    policy = load_policy(ModelConfig(path=str(tiny_dir / "policy"), lora=LORA))
    _train_steps(policy, steps=5, lr=0.05)  # a non-trivial adapter
    policy.save_pretrained(tmp_path / "adapter")

    resumed = load_policy(ModelConfig(path=str(tmp_path / "adapter")))
    reference = Reference.from_policy(resumed)
    ids = torch.tensor([[1, 30, 31, 32, 40, 41, 42]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        policy_lp = response_logprobs(resumed, ids, mask, 4)[0]
        base_lp = response_logprobs(load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"))), ids, mask, 4)[0]
    ref_lp = reference.logprobs(ids, mask, 4)
    assert torch.equal(ref_lp, policy_lp)  # KL = 0 at step 0
    assert (ref_lp - base_lp).abs().max() > 1e-4  # and the reference is not the bare base model
    trainable = [n for n, p in resumed.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".default" in n for n in trainable)
    _train_steps(resumed)
    assert torch.equal(reference.logprobs(ids, mask, 4), ref_lp)
    assert [n for n, p in resumed.named_parameters() if p.requires_grad] == trainable


def test_critic_init_from_reward_or_policy_and_checkpoint_roundtrip(tiny_dir, tmp_path):
    policy_cfg = ModelConfig(path=str(tiny_dir / "policy"))
    reward_cfg = ModelConfig(path=str(tiny_dir / "reward"))
    reward = load_reward_model(reward_cfg)
    critic = load_critic("reward", policy_cfg, reward_cfg)
    assert torch.equal(critic.score.weight, reward.score.weight)
    assert torch.equal(critic.score.bias, torch.zeros(1))
    from_policy = load_critic("policy", policy_cfg, reward_cfg)
    assert not torch.equal(from_policy.score.weight, reward.score.weight)
    with pytest.raises(ValueError, match="init_from"):
        load_critic("random", policy_cfg)

    ids = torch.tensor([[0, 1, 20, 21, 30, 31, 32]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        values = token_values(critic, ids, mask, 3)
    assert values.shape == (1, 3)
    with torch.no_grad():
        critic.score.bias.fill_(0.25)  # a trained critic: the head changed
    critic.save_pretrained(tmp_path / "critic")
    reloaded = load_scalar_model(ModelConfig(path=str(tmp_path / "critic")), "value")
    saved, loaded = critic.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    with torch.no_grad():
        assert_close(token_values(reloaded, ids, mask, 3), token_values(critic, ids, mask, 3))


def test_model_config_validation_names_the_field():
    with pytest.raises(ValueError, match="policy.path"):
        load_policy(ModelConfig())
    with pytest.raises(ValueError, match=r"model.dtype must be one of"):
        ModelConfig(path="x", dtype="float8").validate()
    with pytest.raises(ValueError, match="attn_implementation"):
        ModelConfig(path="x", attn_implementation="fast").validate()


def test_tokenizer_without_pad_uses_eos(tiny_dir, tmp_path):
    tok = load_tokenizer(str(tiny_dir / "policy"))
    tok = copy.deepcopy(tok)
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "nopad")
    assert load_tokenizer(str(tmp_path / "nopad")).pad_token_id == tok.eos_token_id


def test_qwen2_architecture_works_through_the_same_path(tiny_dir, tokenizer):
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "qwen2")))
    ids = torch.tensor([tokenizer("hello").input_ids])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids))
    assert lp.shape == ids.shape and torch.isfinite(lp).all() and lp[0, 0] == 0


@pytest.fixture(scope="module")
def dropout_dir(tiny_dir, tmp_path_factory):
    """Copies of the tiny policy and reward model whose config.json says attention_dropout: 0.1."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("dropout")
    for name in ("policy", "reward"):
        shutil.copytree(tiny_dir / name, root / name)
        path = root / name / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "attention_dropout": 0.1}))
    return root


def _role(dropout_dir, role):
    policy = ModelConfig(path=str(dropout_dir / "policy"), device="cpu")
    reward = ModelConfig(path=str(dropout_dir / "reward"), device="cpu")
    if role == "policy":
        return load_policy(policy)
    if role == "lora_policy":
        return load_policy(dataclasses.replace(policy, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    if role == "reference_copy":
        return Reference.from_policy(load_policy(policy), share="copy").model
    if role == "reference_path":
        return Reference(model=load_causal_lm(policy)).model
    if role == "reward":
        return load_reward_model(reward)
    return load_critic(role.removeprefix("critic_"), policy, reward)


@pytest.mark.parametrize(
    "role",
    ["policy", "lora_policy", "reference_copy", "reference_path", "reward", "critic_reward", "critic_policy"],
)
def test_attention_dropout_of_the_checkpoint_is_off_in_train_mode(dropout_dir, role):
    # issue 9 item 8: disable_dropout zeroed config.attention_dropout after the attention modules had
    # copied it, so attention dropout stayed on in train mode
    model = _role(dropout_dir, role)
    model.train()
    ids = torch.tensor([[1, 20, 30, 40, 50, 60, 70, 80, 90, 15, 25, 35]])
    out1, out2 = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.equal(out1, out2)


@pytest.mark.parametrize("kind", ["full", "new_lora", "trained_adapter"])
def test_loaded_policy_checkpoints_gradients(tiny_dir, tmp_path, kind):
    # issue 9 item 6: models loaded in eval mode (from_pretrained; peft's load_adapter of the frozen
    # reference adapter) never checkpoint; a trained policy is returned in train mode
    path = str(tiny_dir / "policy")
    if kind == "trained_adapter":
        load_policy(ModelConfig(path=path, lora=LORA)).save_pretrained(tmp_path / "adapter")
        path = str(tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        policy = load_policy(
            ModelConfig(path=path, lora=LORA if kind == "new_lora" else None, gradient_checkpointing=True)
        )
    # no transformers deprecation warning about checkpointing, ours or peft's (new-user finding 14)
    assert not [w for w in seen if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)]
    calls = []
    attention = next(m for n, m in policy.named_modules() if n.endswith("layers.0.self_attn"))
    attention.register_forward_hook(lambda module, inputs, output: calls.append(1))
    ids = torch.tensor([[1, 30, 31, 32, 40, 41, 42]])
    response_logprobs(policy, ids, torch.ones_like(ids), 4)[0].sum().backward()
    assert len(calls) == 2  # the forward, and its recomputation in the backward


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_is_peft_model_answers_without_importing_peft(tiny_dir):
    """Asking whether a plain model is a LoRA model must not import peft (~10 MiB of peak RSS, issue 13);
    a LoRA policy is still recognised (then peft is imported: it built the model)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from posttrain.models import ModelConfig, is_peft_model, load_policy\n"
        f"policy = load_policy(ModelConfig(path={str(tiny_dir / 'policy')!r}))\n"
        "assert not is_peft_model(policy) and 'peft' not in sys.modules, 'peft imported'\n"
        f"lora = load_policy(ModelConfig(path={str(tiny_dir / 'policy')!r}, lora={LORA!r}))\n"
        "assert is_peft_model(lora) and not is_peft_model(policy)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_checkpoint_of_the_wrong_kind_is_refused_naming_the_missing_weights(tiny_dir):
    """New-user trial (fourth session): a reward checkpoint loaded as a policy, or a causal LM as the
    reward model, started with a random head and trained or scored without a word (transformers'
    load report is hidden at the CLI's log level). A new head is still expected where one is meant
    to be: a reward model or critic started from a causal LM."""
    with pytest.raises(ValueError, match=r"model.path=.*reward: the checkpoint has no weights for lm_head.weight"):
        load_causal_lm(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"))
    with pytest.raises(ValueError, match=r"reward_model.path=.*policy: the checkpoint has no weights for score.weight"):
        load_reward_model(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    started = load_scalar_model(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"), "reward")  # `posttrain rm`
    assert started.score.weight.shape == (1, started.config.hidden_size)
    assert load_critic("policy", ModelConfig(path=str(tiny_dir / "policy"), device="cpu")) is not None
