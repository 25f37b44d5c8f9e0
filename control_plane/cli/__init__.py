"""The command line: `met` and its subcommands (`main`), the processes it starts and stops
(`launch`, `up`), the control plane's server (`server`) and the generation client
(`generate`)."""
