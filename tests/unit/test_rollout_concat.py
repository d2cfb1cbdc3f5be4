"""`Rollout.concat`, the one way rollouts are joined (sampling batches in evaluation, one prompt's draws in
`generation.generate`): padding on the right side of each part, group ids continued, and the per-row text,
completions, environments, played prompts and tool counts kept."""

import torch

from rlhfkit.types import Rollout, Rows, ToolCounts

PAD = 0


def part(prompt: list[list[int]], response: list[list[int]], groups: list[int], tools: bool = True, texts=True):
    P, R = max(map(len, prompt)), max(map(len, response))
    left = lambda rows, w: torch.tensor([[PAD] * (w - len(r)) + r for r in rows])  # noqa: E731
    right = lambda rows, w: torch.tensor([r + [PAD] * (w - len(r)) for r in rows])  # noqa: E731
    mask = lambda rows, w, l: torch.tensor([([0] * (w - len(r)) + [1] * len(r)) if l else ([1] * len(r) + [0] * (w - len(r)))  # noqa: E731
                                            for r in rows])
    n = len(response)
    counts = ToolCounts(calls=torch.ones(n, dtype=torch.long), failures=torch.zeros(n, dtype=torch.long),
                        timeouts=torch.zeros(n, dtype=torch.long), malformed=torch.zeros(n, dtype=torch.long),
                        turns=torch.ones(n, dtype=torch.long), per_tool=torch.ones(n, 1, dtype=torch.long),
                        tool_names=("add",), well_formed=Rows((True,) for _ in range(n)))
    return Rollout(prompt_ids=left(prompt, P), prompt_mask=mask(prompt, P, True), response_ids=right(response, R),
                   response_mask=mask(response, R, False), group_ids=torch.tensor(groups),
                   has_eos=torch.ones(n, dtype=torch.bool), sampler_logprobs=-right(response, R).float() * mask(response, R, False),
                   action_mask=mask(response, R, False),
                   texts=Rows(f"t{r}" for r in response) if texts else None,
                   completions=Rows([{"role": "assistant", "content": f"t{r}"}] for r in response) if texts else None,
                   prompts=Rows(f"p{p}" for p in prompt), tools=counts if tools else None)


def test_parts_are_padded_renumbered_and_keep_their_rows():
    a = part([[5, 6], [5, 6]], [[7], [8, 9]], [0, 0])
    b = part([[4, 5, 6]], [[1, 2, 3]], [0])
    ro = Rollout.concat([a, b], PAD)
    assert ro.prompt_ids.tolist() == [[0, 5, 6], [0, 5, 6], [4, 5, 6]]
    assert ro.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1]]
    assert ro.response_ids.tolist() == [[7, 0, 0], [8, 9, 0], [1, 2, 3]]
    assert ro.response_mask.tolist() == ro.action_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert ro.sampler_logprobs.tolist() == [[-7, 0, 0], [-8, -9, 0], [-1, -2, -3]]
    assert ro.group_ids.tolist() == [0, 0, 1]  # b's group 0 follows a's last group
    assert list(ro.texts) == ["t[7]", "t[8, 9]", "t[1, 2, 3]"] and len(ro.completions) == 3
    assert list(ro.prompts) == ["p[5, 6]", "p[5, 6]", "p[4, 5, 6]"]
    assert ro.tools.calls.tolist() == [1, 1, 1] and ro.tools.tool_names == ("add",)
    assert list(ro.tools.well_formed) == [(True,)] * 3


def test_what_one_part_lacks_the_whole_lacks():
    ro = Rollout.concat([part([[1]], [[2]], [0]), part([[1]], [[3]], [0], tools=False, texts=False)], PAD)
    assert ro.tools is None and ro.texts is None and ro.completions is None and list(ro.prompts) == ["p[1]", "p[1]"]
