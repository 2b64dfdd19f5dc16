"""The workflows mlrl ships, registered by name on import: `rlvr` (`mlrl.workflow.builtin.rlvr`,
single-turn verifiable reward), `multi_turn` (`.multi_turn`, answer / environment feedback / retry)
and `openai_agent` (`.agent`, an agent written against the OpenAI client, run through
`mlrl.workflow.agent_proxy`).

They sit apart from the workflow machinery (api, runner, registry, samples) because they are users
of it, written the way user workflows are. Nothing is imported here: `mlrl.workflow.registry`
imports the three modules the first time a workflow is looked up, which keeps `import mlrl.workflow`
light.
"""
