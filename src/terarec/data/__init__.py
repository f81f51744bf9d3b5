"""terarec.data"""
