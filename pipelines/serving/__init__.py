"""Serving: score a live Kafka stream of any dataset's events with Beam ``RunInference``.

Modules by job:

- ``config``: ``ScoreConfig`` and ``ScoringBatch`` (a featurized micro-batch);
- ``versions``: the model-updates records -> the newest valid, authenticated version
  (``VersionTracker``, the scorer's own model copies ``ModelCache``);
- ``updates``: reading the updates topic (``wait_for_version`` at the start, then ``NewestVersion``: a reader
  thread per worker process that the handler asks before each forward);
- ``handler``: ``FlowtrainModelHandler``, RunInference's model handler (serves the newest version read, never
  backwards);
- ``featurize``: raw events -> ``ScoringBatch``es with the stream pipeline's featurizer;
- ``predictions``: ``prediction_layout`` (the ``pred_*`` columns of ``flowtrain predict``) and ``WritePredictions``;
- ``codec``: the predictions' formats on the topic (``PredictionsCodec``);
- ``commit``: ``CommitScored``, at-least-once commits of the raw offsets;
- ``scoring``: ``build_scoring_pipeline``, the whole pipeline.
"""
