"""Microbenchmarks that measure what one GPU achieves -> a `gobrrr.hardware.Calibration`:
`api.calibrate` runs them, `sections/` holds one module per kernel class, `timing` times."""
