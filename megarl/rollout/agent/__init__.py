"""Multi-turn rollouts with tools (the agent loop), engine-agnostic, with exact token ids.

- `loop.run_agent_loop`: generate a turn for every live trajectory in one engine call, parse
  its tool calls, run the tools, append their responses as the chat template renders them;
  `Trajectory` holds the ids, the mask (1 = model-generated) and the engine's logprobs.
- `tools`: verl's tool protocol (`BaseTool`, `OpenAIFunctionToolSchema`, `ToolResponse`), the
  tool config loader (`load_tools`), `CalculatorTool` and the sandboxed `PythonTool`.
- `tool_parser`: tool-call formats by name (``hermes``).
- `interactions`: verl's interaction protocol (`BaseInteraction`: a simulated user answering
  turns without a tool call), its YAML (`load_interactions`) and verl's gsm8k interaction.

Used by the trainer with rollout.multi_turn.enable (megarl/trainer/generation.py; see
docs/design.md, "Multi-turn rollouts with tools").
"""

from megarl.rollout.agent.interactions import BaseInteraction, Gsm8kInteraction, load_interactions
from megarl.rollout.agent.loop import AgentLoopSettings, Trajectory, run_agent_loop
from megarl.rollout.agent.tools import (
    BaseTool,
    CalculatorTool,
    Gsm8kTool,
    OpenAIFunctionToolSchema,
    PythonTool,
    ToolResponse,
    load_tools,
    tool_schemas,
)

__all__ = ["AgentLoopSettings", "BaseInteraction", "BaseTool", "CalculatorTool",
           "Gsm8kInteraction", "Gsm8kTool", "OpenAIFunctionToolSchema", "PythonTool",
           "ToolResponse", "Trajectory", "load_interactions", "load_tools", "run_agent_loop",
           "tool_schemas"]
