"""The engine loop: schedule -> execute -> update (EngineCore), the scheduler, the start-up steps."""
