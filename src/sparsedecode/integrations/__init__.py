"""Adapters to other tools. Each lives in a module of its own that imports its tool, so
`import sparsedecode` never needs them: `sparsedecode.integrations.lm_eval` (pip install
"sparsedecode[lmeval]") runs lm-evaluation-harness tasks on the engine under a configuration."""
