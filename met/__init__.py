"""The `met` command (`main`): it dispatches to `control_plane.cli` for the serving commands,
`gpu_service` for the GPU service's, `training` for training and `init-model`, and `tools` for
`met bench`. Nothing in the serving packages imports it."""
