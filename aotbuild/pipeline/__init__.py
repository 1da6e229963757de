"""The pipeline as loaded and changed: finding and loading models (models), the pipeline's call
(pipecall), the blocks of regional scope (blocks), a module's structure (structure), what its graphs
depend on (dependencies), the declared pipeline changes (changes) and the text length that follows the
prompt (textlen); whether the Hugging Face Hub can be reached (hub)."""
