"""Task data (not a service): synthetic search world, countdown, math word problems, dataset
formats, SFT demonstrations and the tiny-policy builder (docs/architecture.md)."""
