"""A tiny package laid out as real projects are: a model module and a training module that imports it
relatively. `opadvisor profile -m trainpkg.train` profiles it as `python -m trainpkg.train` runs it."""
