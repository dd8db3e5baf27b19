"""The tagging task and what it calls: the classify step (`classify`: records + the index's
committed view -> one operation per record), the task that runs it on executors (`executor`,
inside `mapInArrow`) or in the driver's process, partial updates (`partial`), global scope's
moves (`moves`), key-only deletes' placement (`placement`), append-only tables (`append_only`),
a history batch's writes (`history_writes`), the file-writing tasks (`writing`), what a task
gets (`task_context`) and sends back (`task_stats`, `outcomes`), and the executors' replicas at
the end of a stream (`release`).

It may import the index, the commit paths and engines (`sink.lakehouse`), the Delta log, the
session, the config and the stream's routing columns (`sink.routing`); never the batch's phases
(`sink.batch`) nor the ops. Its modules are pickled into Spark tasks by their paths here."""
