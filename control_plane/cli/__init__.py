"""The control plane's commands, which `met` (the top-level `met` package) dispatches to: the
processes they start and stop (`launch`, `up`), the control plane's server (`server`) and the
generation client (`generate`)."""
