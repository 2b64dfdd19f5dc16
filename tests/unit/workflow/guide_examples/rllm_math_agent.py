# Source: https://github.com/rllm-org/rllm (Apache-2.0).
# rLLM's agent + environment workflow: its MathAgent (rllm/agents/math_agent.py), its
# MultiTurnEnvironment / SingleTurnEnvironment (rllm/environments/base/), driven by rLLM's
# MultiTurnWorkflow as its workflows guide shows:
#     MultiTurnWorkflow(agent_cls=MyAgent, env_cls=MyEnv, agent_args={...},
#                       env_args={"reward_fn": reward_fn}, max_steps=5, rollout_engine=engine, executor=executor)
# Code below is rLLM's, with its imports changed:
#   from rllm.agents.agent import BaseAgent;  from rllm.types import Action, Step, Trajectory
#   from rllm.environments.base.base_env import BaseEnv
#   from rllm.rewards.reward_fn import RewardFunction, zero_reward   (-> the small exact-match reward below)
# and the environments' `warnings.warn` on a missing reward function kept as is.
import copy
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from mlrl.workflow.compat.rllm import Action, BaseAgent, BaseEnv, Step, Trajectory


class MathAgent(BaseAgent):
    """
    A math agent that solves mathematical problems step by step, following the BaseAgent interface.
    """

    def __init__(self, accumulate_thinking=True):
        """
        Initialize the MathAgent.
        """
        self._trajectory = Trajectory()
        self.messages = []
        self.accumulate_thinking = accumulate_thinking

    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict, **kwargs):
        """Process environment feedback and update internal state."""

        # Reward update for existing step (None OR empty dict)
        if observation is None or (isinstance(observation, dict) and observation == {}):
            if self.trajectory.steps:
                cur_step = self.get_current_state()
                cur_step.reward = reward
                cur_step.done = done
                cur_step.info = info
            return

        # This is a new observation, create a new step
        if isinstance(observation, dict):
            if "question" not in observation:
                raise ValueError(f"Observation dict missing required 'question' field: {observation}")
            formatted_observation = observation["question"]
        elif isinstance(observation, str):
            formatted_observation = observation
        else:
            raise ValueError(f"Invalid observation type: {type(observation)}")

        self.messages.append({"role": "user", "content": formatted_observation})

        new_step = Step(observation=formatted_observation)
        self._trajectory.steps.append(new_step)

    def update_from_model(self, response: str, **kwargs) -> Action:
        """
        Updates the agent's internal state based on the model's response.
        """

        # Update the latest step
        self.messages.append({"role": "assistant", "content": response})

        cur_step = self.get_current_state()
        cur_step.chat_completions = self.chat_completions
        cur_step.model_response = response

        if response.count("</think>") == 1:
            thought, sep, action = response.partition("</think>")
            thought = thought + sep
            action = Action(action=action.strip())
        else:
            thought = None
            action = Action(action=response.strip())

        cur_step.thought = thought
        cur_step.action = action

        return action

    def reset(self) -> None:
        """Reset agent state for new episode (wipes trajectory and messages)."""
        self._trajectory = Trajectory()
        self.messages = []

    @property
    def chat_completions(self) -> list[dict[str, str]]:
        """Return conversation history for model interaction."""
        # remove thinking from assistant messages if not accumulate_thinking except the last one
        messages = copy.deepcopy(self.messages)
        if not self.accumulate_thinking:
            for msg in messages[:-1]:
                if msg["role"] == "assistant":
                    _, sep, after = msg["content"].partition("</think>")
                    if sep:
                        msg["content"] = after
        return messages

    @property
    def trajectory(self) -> Trajectory:
        """Return complete interaction trajectory."""
        return self._trajectory

    def get_current_state(self) -> Step:
        """Returns the current step/state of the agent."""
        assert self._trajectory.steps, "Trajectory should not be empty when get_current_state is called."
        return self._trajectory.steps[-1]


class MultiTurnEnvironment(BaseEnv, ABC):
    """
    An environment for multi-turn interactions with LLMs.
    The environment provides a series of questions/prompts and evaluates responses using a custom reward function.
    The interaction terminates after reaching the maximum number of turns.
    """

    def __init__(self, task: dict | None = None, max_turns: int = 3, **kwargs):
        super().__init__()
        self.task = task
        self.max_turns = max_turns
        self.current_turn = 0
        self.done = False
        self.history = []

    def reset(self, task: dict | None = None):
        # Use the provided task if available, otherwise use the default task
        if task is not None:
            self.task = task

        self.done = False
        self.current_turn = 0
        self.history = []

        return self.task, {}

    def step(self, action):
        # Store the action in history
        self.history.append(action)

        # Calculate reward for the current turn using the abstract method
        assert self.task is not None, "Task is not set"
        reward, next_obs = self.get_reward_and_next_obs(self.task, action)

        # Increment turn counter
        self.current_turn += 1

        # Check if we've reached the maximum number of turns
        if self.current_turn >= self.max_turns:
            self.done = True
            return {}, reward, self.done, self.task

        return next_obs, reward, self.done, self.task

    @abstractmethod
    def get_reward_and_next_obs(self, task: dict, action: Any) -> tuple[float, dict]:
        pass


@dataclass
class RewardOutput:
    reward: float
    is_correct: bool = False


def zero_reward(task_info: dict, action: Any) -> RewardOutput:
    return RewardOutput(reward=0.0)


def exact_match_reward_fn(task_info: dict, action: Any) -> RewardOutput:
    """An rLLM-style reward function (task_info, action) -> RewardOutput."""
    answer = action.action if isinstance(action, Action) else action
    correct = str(answer).strip() == str(task_info["ground_truth"]).strip()
    return RewardOutput(reward=float(correct), is_correct=correct)


class SingleTurnEnvironment(MultiTurnEnvironment):
    """
    A simple environment for single-turn interactions with LLMs.
    This is a special case of MultiTurnEnvironment where max_turns=1.
    The environment provides a question/prompt and evaluates the response using a custom reward function.
    """

    def __init__(self, task: dict | None = None, reward_fn=None, **kwargs):
        super().__init__(task=task, max_turns=1, **kwargs)
        if reward_fn is None:
            warnings.warn("No reward function provided, using zero reward", stacklevel=2)
        self.reward_fn = reward_fn or zero_reward

    def get_reward_and_next_obs(self, task: dict, action: Any) -> tuple[float, dict]:
        reward_output = self.reward_fn(task_info=task, action=action)

        return reward_output.reward, {}

    @staticmethod
    def from_dict(env_args: dict) -> "SingleTurnEnvironment":
        reward_fn = env_args.pop("reward_fn", None)
        if "task" in env_args:
            task = env_args["task"]
        else:
            task = env_args
        return SingleTurnEnvironment(task=task, reward_fn=reward_fn)
