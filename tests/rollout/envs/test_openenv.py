"""OpenEnv environments as align environments (align.rollout.envs.openenv): small environments written here
against OpenEnv's own classes, played in this process and served by OpenEnv's HTTP server on loopback; scripted
replies give the observations, rewards and ends worked out by hand, the same on both."""

import pytest
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

from align.errors import AlignConfigError, AlignEnvError
from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec
from align.rollout.envs.openenv import (
    InvalidAction,
    OpenEnvEnvironment,
    check_fields,
    observation_text,
    read_action,
    text_fields,
)
from align.rollout.envs.openenv_tasks import serve


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str = ""
    guesses: int = 0


class GuessNumber(Environment[GuessAction, GuessObservation, State]):
    """The secret is ``seed % 10``; each guess is answered with higher/lower; a right guess earns
    ``1 / guesses`` and ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, greeting: str = "Guess a number from 0 to 9."):
        super().__init__()
        self.greeting, self._state = greeting, State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.secret, self._state = (seed or 0) % 10, State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback=self.greeting)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        n = self._state.step_count
        if action.guess == self.secret:
            return GuessObservation(feedback="right", guesses=n, done=True, reward=1.0 / n)
        return GuessObservation(feedback="higher" if action.guess < self.secret else "lower", guesses=n, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""


class Echo(Environment[EchoAction, EchoObservation, State]):
    """Echoes the message; reward = its length / 10; done after the message 'bye'."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, topic: str = "anything", **kwargs) -> EchoObservation:
        return EchoObservation(echoed=f"Say something about {topic}.")

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        return EchoObservation(echoed=action.message, reward=len(action.message) / 10, done=action.message == "bye")

    @property
    def state(self) -> State:
        return State()


def parse_guess(text: str) -> dict:
    """A parser for tests: the last word of the reply is the guess (ValueError: an empty reply holds none)."""
    if not text.split():
        raise ValueError("an empty reply")
    return {"guess": text.split()[-1]}


@pytest.fixture(scope="module")
def servers():
    """GuessNumber and Echo, each served by OpenEnv's HTTP server on a loopback port of its own."""
    started = [
        serve(create_fastapi_app(GuessNumber, GuessAction, GuessObservation, max_concurrent_envs=64)),
        serve(create_fastapi_app(Echo, EchoAction, EchoObservation, max_concurrent_envs=8)),
    ]
    yield {"guess": started[0][0], "echo": started[1][0]}
    for _, stop in started:
        stop()


def make(kind: str, where: str, servers, **kwargs) -> OpenEnvEnvironment:
    if where == "served":
        return OpenEnvEnvironment(url=servers[kind], **kwargs)
    return OpenEnvEnvironment(env_class=GuessNumber if kind == "guess" else Echo, **kwargs)


def row(**columns) -> dict:
    return {"prompt": "play", "messages": [{"role": "user", "content": "play"}], **columns}


def say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_the_mapping_helpers_by_hand():
    assert text_fields(EchoAction.model_json_schema()) == ["message"]
    assert text_fields(GuessAction.model_json_schema()) == []
    assert text_fields(GuessObservation.model_json_schema()) == ["feedback"]
    assert read_action(say("hi"), "message", None) == {"message": "hi"}
    assert read_action(say('I guess {"guess": 4} now {"guess": 5}'), None, "json") == {"guess": 4}
    assert read_action(say('<tool_call>{"name": "g", "arguments": {"guess": 3}}</tool_call>'), None, "tool_call") == {
        "guess": 3
    }
    assert read_action(
        {**say("x"), "tool_calls": [{"function": {"name": "g", "arguments": '{"guess": 2}'}}]}, None, "tool_call"
    ) == {"guess": 2}
    assert read_action(say("my guess is 7"), None, parse_guess) == {"guess": "7"}
    for text, parser in (("no object", "json"), ("[1, 2]", "json"), ("no call", "tool_call")):
        with pytest.raises(InvalidAction):
            read_action(say(text), None, parser)
    schema = GuessAction.model_json_schema()
    check_fields({"guess": 1}, schema)
    with pytest.raises(
        InvalidAction,
        match=r"fields missing \['guess'\], unknown \['gues'\] \(its fields: "
        r"\['guess', 'metadata'\]\)",
    ):
        check_fields({"gues": 1}, schema)
    assert observation_text({"echoed": "hi", "metadata": {}}, None) == "hi"
    assert (
        observation_text({"feedback": "higher", "guesses": 2, "metadata": {"x": 1}}, None)
        == "feedback: higher\nguesses: 2"
    )
    assert observation_text({"feedback": "higher", "guesses": 2}, "guesses") == "2"


@pytest.mark.parametrize("where", ["in_process", "served"])
def test_scripted_guesses_give_the_hand_worked_replies_rewards_and_end(where, servers):
    env = make("guess", where, servers, action_parser="json", observation_field="feedback")
    assert env.reset(row(seed=13)) == [{"role": "user", "content": "Guess a number from 0 to 9."}]
    steps = [
        env.step(say(text))
        for text in ('{"guess": 5}', "seven", '{"guess": "x"}', '{"guess": 1}', '{"gues": 3}', '{"guess": 3}')
    ]
    assert [(s.messages, s.reward, s.done) for s in steps[:2]] == [
        ([{"role": "user", "content": "lower"}], 0.0, False),
        (
            [{"role": "user", "content": 'error: expected a JSON object ({"field": value, ...}) in the reply'}],
            0.0,
            False,
        ),
    ]
    assert steps[2].messages[0]["content"].startswith("error: ") and steps[2].info == {"invalid_actions": 1}
    assert (steps[3].messages, steps[3].reward) == ([{"role": "user", "content": "higher"}], 0.0)
    assert steps[4].messages[0]["content"].startswith("error: not a valid ") and steps[4].info["invalid_actions"] == 1
    # the third valid guess is right: 1 / 3, and no reply
    assert (steps[5].messages, steps[5].reward, steps[5].done, steps[5].info) == (
        [],
        pytest.approx(1 / 3),
        True,
        {"invalid_actions": 0},
    )
    # reset clears the episode: the same environment plays the next one from the start
    env.reset(row(seed=4))
    assert env.step(say('{"guess": 4}'))[1:3] == (1.0, True)
    env.close()


@pytest.mark.parametrize("where", ["in_process", "served"])
def test_text_actions_prompt_modes_and_reset_columns(where, servers):
    env = make(
        "echo",
        where,
        servers,
        prompt="both",
        reset_columns=["topic"],
        observation_role="tool",
        invalid_action_reward=-1.0,
    )
    assert env.action_field == "message"
    system = {"role": "system", "content": "Be brief."}
    assert env.reset({**row(topic="cats"), "messages": [system, {"role": "user", "content": "Hi."}]}) == [
        system,
        {"role": "user", "content": "Hi.\n\nSay something about cats."},
    ]
    assert env.step(say("meow meow")) == (
        [{"role": "tool", "content": "meow meow"}],
        pytest.approx(0.9),
        False,
        {"invalid_actions": 0},
    )
    assert env.step(say("bye"))[1:3] == (pytest.approx(0.3), True)
    with pytest.raises(KeyError, match=r"reset_columns \['topic'\] are not columns of the row"):
        env.reset(row())
    plain = make("echo", where, servers)  # prompt: observation keeps the system message; seed only when present
    assert plain.reset({**row(), "messages": [system, {"role": "user", "content": "Hi."}]}) == [
        system,
        {"role": "user", "content": "Say something about anything."},
    ]
    assert make("echo", where, servers, prompt="row").reset(row()) == [{"role": "user", "content": "play"}]
    env.close()
    plain.close()


def test_an_action_the_model_cannot_build_is_a_reply_and_a_broken_environment_one_line(servers):
    env = OpenEnvEnvironment(env_class=GuessNumber, action_parser=parse_guess)
    env.reset(row(seed=2))
    step = env.step(say("my guess is two"))
    assert step.messages[0]["content"].startswith(
        "error: not a valid GuessAction: guess: Input should be a valid integer"
    ) and step.info == {"invalid_actions": 1}
    assert env.step(say(" ")).messages == [{"role": "user", "content": "error: an empty reply"}]
    assert env.step(say("it is 2"))[1:3] == (1.0, True)  # the invalid replies never reached the environment
    pool = EnvironmentPool(EnvironmentSpec(OpenEnvEnvironment, init_kwargs={"env_class": Echo}, workers=2))
    first = pool.reset([row(), row()], ["episode 0", "episode 1"])
    assert first[0] == [{"role": "user", "content": "Say something about anything."}]
    steps, _ = pool.step([0, 1], [say("x"), say("bye")], ["episode 0", "episode 1"], 1)
    assert [(s.reward, s.done) for s in steps] == [(pytest.approx(0.1), False), (pytest.approx(0.3), True)]
    strict = EnvironmentPool(
        EnvironmentSpec(OpenEnvEnvironment, init_kwargs={"env_class": Echo, "reset_columns": ["topic"]})
    )
    with pytest.raises(AlignEnvError, match=r"episode 0: reset raised KeyError: .reset_columns \['topic'\]"):
        strict.reset([row()], ["episode 0"])


def test_settings_that_cannot_work_fail_on_one_line(servers, tmp_path):
    cases = [
        (
            dict(),
            r"init_kwargs: expected exactly one of env_class \(an environment played in this process\) and url "
            r"\(a running OpenEnv server\), got env_class=None, url=None$",
        ),
        (dict(env_class=Echo, url=servers["echo"]), "init_kwargs: expected exactly one of env_class"),
        (
            dict(env_class=Echo, prompt="first"),
            r"init_kwargs\.prompt: expected one of observation, row, both, got "
            r"'first'$",
        ),
        (
            dict(env_class=Echo, action_field="message", action_parser="json"),
            r"init_kwargs\.action_parser: expected null with action_field set \(set one of them, not both\), got "
            r"'json'$",
        ),
        (
            dict(env_class=Echo, action_field="text"),
            r"init_kwargs\.action_field: expected a field of the action "
            r"\(fields: \['message'\]\), got 'text'$",
        ),
        (
            dict(env_class=GuessNumber),
            r"init_kwargs\.action_field: expected the action's text field to fill, got null, "
            r"and the action has 0 text fields \(\[\]\); set action_field or action_parser$",
        ),
        (
            dict(env_class=dict),
            r"init_kwargs\.env_class: expected a subclass of openenv's Environment, got "
            r"<class 'dict'>$",
        ),
        (
            dict(env_class=type("Bare", (Environment,), {})),
            r"init_kwargs\.env_class: expected an Environment that "
            r"declares its Action and Observation classes",
        ),
        (
            dict(env_class=Echo, observation_field="text"),
            r"init_kwargs\.observation_field: expected a field of the "
            r"observation \(fields: \['echoed'\]\), got 'text'$",
        ),
        (
            dict(url=servers["echo"], init_kwargs={"a": 1}),
            r"init_kwargs\.init_kwargs: expected null with url \(a "
            r"server builds its own environments; init_kwargs are for "
            r"env_class\), got \{'a': 1\}$",
        ),
        (
            dict(url="http://127.0.0.1:9"),
            r"init_kwargs\.url: expected a running OpenEnv server, got "
            r"'http://127\.0\.0\.1:9', whose schema at http://127\.0\.0\.1:9/schema "
            r"cannot be read",
        ),
        (
            dict(env_class=Echo, token_env="ALIGN_TEST_UNSET_TOKEN"),
            r"init_kwargs\.token_env: expected a set "
            r"environment variable, got "
            r"'ALIGN_TEST_UNSET_TOKEN', which is not set$",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(AlignConfigError, match="^" + message):
            OpenEnvEnvironment(**kwargs)
    pool = EnvironmentPool(EnvironmentSpec(OpenEnvEnvironment, init_kwargs={"env_class": Echo, "prompt": "first"}))
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.environment\.init_kwargs\.prompt: expected one of "
        r"observation, row, both, got 'first'$",
    ):
        pool.instance(0)
