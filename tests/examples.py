"""Published CDC examples the tests replay."""

# Databricks' AUTO CDC (APPLY CHANGES) example: changes of users, deleted by
# operation = 'DELETE', sequenced by sequenceNum: (userId, name, city, operation, sequenceNum).
USER_CHANGES = [
    (124, "Raul", "Oaxaca", "INSERT", 1),
    (123, "Isabel", "Monterrey", "INSERT", 1),
    (125, "Mercedes", "Tijuana", "INSERT", 2),
    (126, "Lily", "Cancun", "INSERT", 2),
    (123, None, None, "DELETE", 6),
    (125, "Mercedes", "Guadalajara", "UPDATE", 6),
    (125, "Mercedes", "Mexicali", "UPDATE", 5),
    (123, "Isabel", "Chihuahua", "UPDATE", 5),
]

# Its STORED AS SCD TYPE 2 result: (userId, name, city, __START_AT, __END_AT).
USER_VERSIONS = [
    (123, "Isabel", "Monterrey", 1, 5),
    (123, "Isabel", "Chihuahua", 5, 6),
    (124, "Raul", "Oaxaca", 1, None),
    (125, "Mercedes", "Tijuana", 2, 5),
    (125, "Mercedes", "Mexicali", 5, 6),
    (125, "Mercedes", "Guadalajara", 6, None),
    (126, "Lily", "Cancun", 2, None),
]
# With TRACK HISTORY ON * EXCEPT (city).
USER_VERSIONS_EXCEPT_CITY = [
    (123, "Isabel", "Chihuahua", 1, 6),
    (124, "Raul", "Oaxaca", 1, None),
    (125, "Mercedes", "Guadalajara", 2, None),
    (126, "Lily", "Cancun", 2, None),
]

# Spark Declarative Pipelines' AUTO CDC suite, "the SCD2 auxiliary table dropped between runs":
# target (id, version), STORED AS SCD TYPE 2, sequenced by version; the events come one run
# each. version is stored, so tracked by default: (id, version, __START_AT, __END_AT).
VERSIONED_EVENTS = [(1, 1), (1, 2)]
VERSIONED_HISTORY = [(1, 1, 1, 2), (1, 2, 2, None)]
