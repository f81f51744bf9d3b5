"""terarec.autofeature"""
