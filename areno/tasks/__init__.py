"""Built-in synthetic tasks (data loader + reward, and an agent where the task has tools).

They run offline on the tiny checkpoints, so `areno train` has a default job and the tests a
task whose answer depends on the media.
"""
