# Source: https://github.com/modelscope/Trinity-RFT (Apache-2.0).
# Trinity-RFT's ExampleWorkflow, verbatim from its developer guide ("Workflows (For RL Environment
# Developers)", the complete code example), ported to mlrl by changing its imports:
#   from trinity.common.experience import Experience
#   from trinity.common.models.model import ModelWrapper
#   from trinity.common.workflows.workflow import WORKFLOWS, Task, Workflow
from typing import List

from mlrl.workflow.compat.trinity import WORKFLOWS, Experience, ModelWrapper, Task, Workflow


@WORKFLOWS.register_module("example_workflow")
class ExampleWorkflow(Workflow):

    def __init__(self, task: Task, model: ModelWrapper, auxiliary_models: List):
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        self.question = task.raw_task.get("question")
        self.answer = task.raw_task.get("answer")
        self.rollout_args = task.rollout_args

    def calculate_reward(self, response: str, truth: str) -> float:
        if response == truth:
            return 1.0
        else:
            return 0.0

    def run(self) -> List[Experience]:
        # call the model to generate multiple responses
        responses = self.model.chat(
            [
                {
                    "role": "user",
                    "content": f"Question:\n{self.question}",
                }
            ],
            n=self.rollout_args.n,
            temperature=self.rollout_args.temperature,
        )
        experiences = []
        for response in responses:
            # calulcate reward
            reward: float = self.calculate_reward(response.response_text, self.answer)
            # construct Experience
            experiences.append(
                Experience(
                    tokens=response.tokens,
                    prompt_length=response.prompt_length,
                    reward=reward,
                    logprobs=response.logprobs,
                )
            )
        return experiences

    def resettable(self):
        return True

    def reset(self, task: Task):
        self.question = task.raw_task.get("question")
        self.answer = task.raw_task.get("answer")
