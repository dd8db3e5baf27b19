"""A stand-in for a Spark session of which only the conf is read (`spark.conf.get`)."""


class Conf:
    def __init__(self, values):
        self._values = values

    def get(self, key, default=None):
        return self._values.get(key, default)


class ConfSession:
    def __init__(self, **conf):
        self.conf = Conf(conf)
