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
