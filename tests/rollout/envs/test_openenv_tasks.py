"""The OpenEnv environment that ships with align (align.rollout.envs.openenv_tasks): letter sorting over rounds,
played in this process and served over HTTP, the same rounds for the same seed, or the rounds of a row."""

from align.rollout.envs.openenv import OpenEnvEnvironment
from align.rollout.envs.openenv_tasks import serve


def row(**columns) -> dict:
    return {"prompt": "play", "messages": [{"role": "user", "content": "play"}], **columns}


def say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_the_shipped_letter_sort_environment_in_process_and_served():
    from align.data import sort_task
    from align.rollout.envs.openenv_tasks import LetterSortEnv, make_app

    url, stop = serve(make_app(4, rounds=2))
    try:
        local = OpenEnvEnvironment(env_class=LetterSortEnv, init_kwargs={"rounds": 2})
        served = OpenEnvEnvironment(url=url)
        for seed in (5, 6):  # a seed draws the same rounds in this process and on the server
            first = local.reset(row(seed=seed))
            assert served.reset(row(seed=seed)) == first and first[0]["content"].startswith("sort: ")
            for env in (local, served):
                second = env.step(say(sort_task.solve(first[0]["content"])))
                assert second.reward == 0.5 and not second.done
                assert env.step(say(sort_task.solve(second.messages[0]["content"])))[1:3] == (0.5, True)
        played = OpenEnvEnvironment(env_class=LetterSortEnv, reset_columns=["prompt", "rounds"])
        assert played.reset(row(prompt="sort: d a c", rounds=["sort: b a"])) == [
            {"role": "user", "content": "sort: d a c"}
        ]
        assert played.step(say("a c d")) == (
            [{"role": "user", "content": "sort: b a"}],
            0.5,
            False,
            {"invalid_actions": 0},
        )
        assert played.step(say("b a"))[1:3] == (0.0, True)
        served.close()
    finally:
        stop()
