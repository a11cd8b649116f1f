"""The generator engine: scheduler, cache, runner, sampler and the async engine API."""
