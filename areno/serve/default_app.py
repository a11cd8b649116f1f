"""The Serve application on its defaults, for `serve build`, which wants an Application object:

    serve build areno.serve.default_app:app -o serve.yaml

writes a Serve config file listing AReno's four deployments with their options; edit it (or use
deployments/*.yaml, whose `import_path: areno.serve.app:app_builder` takes `args`) and `serve
deploy` / `serve run` it. Importing this module builds the embedded tiny checkpoint if it is not
cached yet; the app serves that checkpoint.
"""

from __future__ import annotations

from areno.serve.app import app_builder

app = app_builder({})
