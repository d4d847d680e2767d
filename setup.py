"""Packaging for nanoserve: every field comes from settings.ini (nbdev 2 keeps its settings there)."""
from configparser import ConfigParser
from pathlib import Path
import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=['='])
cfg.read(here/'settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()
lic = licenses[cfg['license']]
min_python = cfg['min_python']
readme = here/'README.md'

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=readme.read_text(encoding='utf-8') if readme.exists() else cfg['description'],
    long_description_content_type='text/markdown',
    keywords=cfg['keywords'].split(),
    license=lic[0],
    author=cfg['author'],
    author_email=cfg['author_email'],
    url=cfg['git_url'],
    project_urls={'Documentation': cfg['doc_host'] + cfg['doc_baseurl'], 'Source': cfg['git_url']},
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])], 'Intended Audience :: ' + cfg['audience'].title(),
                 'License :: ' + lic[1], 'Natural Language :: ' + cfg['language'].title()] +
                ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    include_package_data=True,
    package_data={cfg['lib_path'] + '.server': ['playground.html']},   # chapter 14j's page, a hand-written static file
    install_requires=cfg.get('requirements', '').split(),
    extras_require={'dev': cfg.get('dev_requirements', '').split(), 'ray': cfg.get('ray_requirements', '').split(),
                    'structured': cfg.get('structured_requirements', '').split()},
    python_requires='>=' + min_python,
    zip_safe=False,
    entry_points={
        'console_scripts': cfg.get('console_scripts', '').split(),
        'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
)
