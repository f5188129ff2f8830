"""The steps of the corpus build, one module each (`base.Step`); `data_pipelines.pipeline.STEPS` orders them."""
