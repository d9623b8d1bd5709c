"""A reward function that combines the copy task's rule with the reward model, as verl lets one: verl's
reward loop gives it `reward_router_address` and `reward_model_tokenizer` (tests/e2e/test_reward_model_e2e.py)."""

import json
import urllib.request


def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address=None,
                  reward_model_tokenizer=None):
    """1 for an exact copy, 0 otherwise, plus the reward model's score of the prompt (the ground truth's
    digits) and the response under its chat template."""
    text = reward_model_tokenizer.apply_chat_template(
        [{"role": "user", "content": ground_truth}, {"role": "assistant", "content": solution_str}],
        add_generation_prompt=False, tokenize=False)
    body = json.dumps({"model": "rm", "input": text, "use_activation": False}).encode()
    request = urllib.request.Request(f"http://{reward_router_address}/classify", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        score = json.loads(answer.read())["data"][-1]["probs"][-1]
    return float(solution_str == ground_truth) + score
