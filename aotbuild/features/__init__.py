"""Features: the changes a recipe makes to a pipeline. The protocol is ``aotbuild.features.base``,
the table of every feature ``aotbuild.features.registry``; one module each (lora, quantization,
parallel; the declared changes are aotbuild/pipeline/changes.py)."""
